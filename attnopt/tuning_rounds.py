"""How the measured choice (``attnopt.tuning``) times one shape's candidates: their compile before any timing
(the warm-up), the round-robin rounds with pruning, the tie-break at a bucket's ends or a static cache's low fill, and
a growing cache's cost of a new length for cuDNN. ``Tuner`` inherits these; the constants are re-exported there."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

from .plan import Plan, reads_valid_keys
from .site import AttentionSite
from .timer import error_text as _error_text
from .timer import warm_workers
from .tuning_candidates import PEER_MARGIN, grid_siblings, near_peer, prefer_peer, variant_twins

#: After the first round, only candidates within this fraction of the best are timed again.
PRUNE = 0.15
#: After the second, only those within this fraction of the best's median of two: a candidate this far behind on both
#: samples does not win a choice decided by 1 % (and at 12-18 candidates a bucket, most within ``PRUNE`` of the best
#: at round one, the third round was a third of a growing cache's timings).
PRUNE_LATE = 0.05
#: The candidates within this fraction of the fastest once the rounds are done (at most ``TIE_MAX``, and the fastest
#: dense plan where it is that close) are timed ``DUEL_ROUNDS`` more times each, alternating their order (ABBA), and
#: each keeps the median of all its samples: the winner of a 1 % choice was often decided by one sample of three
#: (H100, 8e6ae2d: the planner's pick and cuDNN 0.5-1.5 % apart in 6 of 20 cases, round-to-round noise about 1 %).
#: A timed graph is replayed again, not captured: each sample costs only its replays.
DUEL_WITHIN = 0.02
DUEL_ROUNDS = 4
#: Seconds after which no further duel round starts.
DUEL_S = 0.5
#: A bucket's runner-up within this fraction of its fastest is timed with it at the bucket's ends (``span``); a
#: static cache's, at ``STATIC_LOW_FILL``.
TIE = 0.03
#: A static cache's dense (whole-cache) winner is also judged at ``STATIC_LOW_FILL`` against the fastest plan that
#: reads only the valid keys when that plan is within this fraction of it full: the fill is unknown when the graph
#: compiles, and at a low fill the dense plan keeps its full time while the other shrinks (H100, f9e648f: timed full
#: only, cuDNN won 4k of a 32k cache at 1.0x SDPA over the whole cache, where the split-KV plan runs about 8x).
STATIC_DENSE_TIE = 0.25
#: The hint's bucket is timed at the length the site runs at now (``tuning_buckets.hint_length``); there only
#: candidates within this fraction of its fastest (timing noise: the peer's own time moved 0.1-0.2 % between H100
#: runs at 137-487 µs) are judged at the bucket's other lengths: a plan slower where it runs now loses to the peer
#: there by as much for a better worst case elsewhere (H100, 8a4f996: lhs00, B17 56/56 D128 q4 at 3008 keys, at
#: 1 % took split-KV S1/128, 489.5 µs there against stream-K's 486.5 and 1 % ahead at 4096: 0.986x cuDNN; the
#: stream-K pick had run 0.993x at 3fed422).
HINT_TIE = 0.005
#: Seconds the grid siblings (``tuning_candidates.grid_siblings``) may take past the budget: a few timings of
#: compiled kernels.
SIBLINGS_S = 0.5
#: At most this many near-tied candidates are timed again.
TIE_MAX = 3
#: A static cache's dense winner is judged at ``STATIC_LOW_FILL`` against this many plans that read only the valid
#: keys (those within ``STATIC_DENSE_TIE`` of it full, fastest first): the fastest of them full need not be the fastest
#: over an eighth of the keys, where more splits fill the GPU (4k of a 32k cache: the model's S=16/128 ran 16.9 µs,
#: 3.4x SDPA over the whole cache, on the H100 at f9e648f; the issue asks 5x).
STATIC_READERS = 6
#: A symbolic length's cuDNN plan is charged the extra µs of a call at a new length (``Tuner._fresh_length_charge``)
#: when it exceeds this: host noise between two eager calls stays well below it, a cuDNN graph build far above.
FRESH_LENGTH_SLACK_US = 100.0


def _charged_medians(samples: dict[str, list[float]], charge: dict[str, float]) -> dict[str, float]:
    """Each timed candidate's median µs with its ``charge`` added (runtime key -> µs; keys with no sample left
    out)."""
    return {k: _median(v) + charge.get(k, 0.0) for k, v in samples.items() if v}


class TimingRounds:
    """The timing half of ``tuning.Tuner`` (which sets ``timer``, ``budget_s``, ``rounds`` and ``_fresh``)."""

    def _warm_up(self, plans: Sequence[Plan], site: AttentionSite, eager: bool) -> dict[str, Any]:
        """Let the timer compile the candidates at once before any is timed (``timer.warm_up(plans, site, eager=)``,
        where it has one; ``GpuTimer`` makes their first calls on a thread each): a cold Triton compile costs about
        a second per configuration, which one after another spent the budget before the fastest family was timed
        (the H100 at f9e648f: SmolLM2's 1k static site kept S=5/256/8/2, 7.78 µs, where S=16/64/4/3 ran in 7.25).
        The warm-up counts against the budget. With no budget only the two candidates always timed are warmed.
        Returns the extras to record: its seconds and its errors (the candidates are timed all the same)."""
        warm_up = getattr(self.timer, "warm_up", None)
        if warm_up is None:
            return {}
        warm_workers()  # a bad ATTNOPT_TUNE_WARM_WORKERS is the user's error to see, not a warm-up failure to record
        started = time.perf_counter()
        try:
            errors = warm_up(list(plans if self.budget_s > 0 else plans[:2]), site, eager=eager)
        except Exception as exc:  # noqa: BLE001 - then each candidate compiles when it is first timed, as before
            errors = {"warm_up": _error_text(exc)}
        extra: dict[str, Any] = {"warm_up_s": round(time.perf_counter() - started, 3)}
        if errors:
            extra["warm_up_errors"] = dict(errors)
        procs = getattr(self.timer, "last_warm_up", None) or {}
        if "calls_cpu_s" in procs:  # the CPU seconds of its first calls (in the timing process), on every thread
            extra["warm_up_calls_cpu_s"] = procs["calls_cpu_s"]
        if "timer" in procs:  # where the timing ran (``attnopt.timer_proc``)
            extra["timer"] = procs["timer"]
        if procs.get("procs"):  # the share compiled in worker processes (``attnopt.tuning_procs``)
            extra.update(compile_procs=procs["procs"], compile_procs_s=procs["procs_s"])
            if procs["errors"]:
                extra["compile_procs_errors"] = dict(procs["errors"])
        return extra

    def _fresh_length_charge(self, plans: Sequence[Plan], site: AttentionSite,
                             charge: dict[str, float]) -> dict[str, Any]:
        """A symbolic length runs at a new length every step: add to each cuDNN plan's ``charge`` (µs added to its
        timings) what a call at a new length costs over a call at a known one (``timer.fresh_length_us``), where that
        exceeds ``FRESH_LENGTH_SLACK_US``. PyTorch builds a cuDNN SDPA graph per shape unless
        ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, which a replayed timing at one length never shows. Returns the extras
        to record (``fresh_length_us``: key -> [fresh µs, repeat µs] or the probe's error)."""
        probe = getattr(self.timer, "fresh_length_us", None)
        if probe is None:
            return {}
        seen: dict[str, Any] = {}
        for plan in plans:
            key = plan.runtime_key()
            if plan.kind != "dense" or getattr(plan, "backend", "") != "cudnn":
                continue
            which = _fresh_key(plan, site)  # probed once per site apart from its length: its buckets share it
            if which not in self._fresh:
                try:
                    self._fresh[which] = [float(x) for x in probe(plan, site)]
                except Exception as exc:  # noqa: BLE001 - a probe that fails does not decide; say so
                    self._fresh[which] = _error_text(exc)
            seen[key] = self._fresh[which]
            if isinstance(seen[key], list) and seen[key][0] - seen[key][1] > FRESH_LENGTH_SLACK_US:
                charge[key] = charge.get(key, 0.0) + seen[key][0] - seen[key][1]
        return {"fresh_length_us": seen} if seen else {}

    def _per_length_us(self, plan: Plan, site: AttentionSite) -> float | None:
        """What a new KV length costs ``plan`` beyond ``FRESH_LENGTH_SLACK_US`` at this site, where an earlier
        bucket probed it (``_fresh_length_charge``); else ``None``."""
        probed = self._fresh.get(_fresh_key(plan, site))
        if isinstance(probed, list) and probed[0] - probed[1] > FRESH_LENGTH_SLACK_US:
            return probed[0] - probed[1]
        return None

    def _time_siblings(self, ranked: Sequence[Plan], site: AttentionSite, samples: dict[str, list[float]],
                       timings: dict[str, Any], charge: dict[str, float], end: float, eager: bool,
                       near: bool = True) -> dict[str, Any]:
        """Time the other grids of the fastest kernel configurations (``grid_siblings``) beside the fastest kernel
        plan, within the budget or ``SIBLINGS_S`` past it (after their warm-up), then those of the further close
        configurations nearest the fastest plan's grid where ``near`` (``grid_siblings``'s ``near``: once the first
        siblings are timed, the fastest is more often the grid that fits), and add their samples (and errors) to
        ``samples`` / ``timings``; each is charged as the configuration's timed plan is (the same kind). Returns the
        extras to record (``grid_siblings`` / ``near_siblings``: the keys timed, ``siblings_warm_up_s`` /
        ``near_warm_up_s``)."""
        extra: dict[str, Any] = {}
        for stage, name, short in ((False, "grid_siblings", "siblings"), (True, "near_siblings", "near")):
            if stage and not near:
                break
            measured = _charged_medians(samples, charge)
            more = grid_siblings(measured, ranked, set(samples) | set(timings), n_keys=site.kv_len, near=stage)
            extra.update(self._time_more(name, short, more, ranked, site, samples, timings, charge, end, eager))
        return extra

    def _time_twins(self, ranked: Sequence[Plan], site: AttentionSite, samples: dict[str, list[float]],
                    timings: dict[str, Any], charge: dict[str, float], end: float, eager: bool) -> dict[str, Any]:
        """Time the twins (``variant_twins``: L2 prefetch, head chunks, swapped products, pointer loads) of the
        fastest measured kernel plans as ``_time_siblings`` times grids, however late the siblings ran: they are at
        most ``TWINS_MOST``, and the fastest plan's own (``SIBLINGS_S`` after their warm-up). Returns the extras to
        record (``twins``: the keys timed, ``twins_warm_up_s``)."""
        measured = _charged_medians(samples, charge)
        more = variant_twins(measured, ranked, set(samples) | set(timings))
        return self._time_more("twins", "twins", more, ranked, site, samples, timings, charge, end, eager,
                               late=True)

    def _time_more(self, name: str, short: str, more: Sequence[Plan], ranked: Sequence[Plan], site: AttentionSite,
                   samples: dict[str, list[float]], timings: dict[str, Any], charge: dict[str, float], end: float,
                   eager: bool, late: bool = False) -> dict[str, Any]:
        """Compile ``more`` (kernel plans), then time them beside the fastest measured kernel plan until the budget's
        ``end`` or ``SIBLINGS_S`` after the warm-up, whichever is later; nothing once ``SIBLINGS_S`` past ``end``
        unless ``late``.
        Their samples and errors go to ``samples`` / ``timings``; the extras name them (``name``) and the warm-up's
        seconds (``<short>_warm_up_s``)."""
        if not more or (time.perf_counter() > end + SIBLINGS_S and not late):
            return {}
        measured = _charged_medians(samples, charge)
        by_key = {p.runtime_key(): p for p in ranked}
        best = min((k for k in measured if by_key[k].kind != "dense"), key=measured.get)
        for p in more:
            charge[p.runtime_key()] = charge.get(best, 0.0)
        extra: dict[str, Any] = {name: [p.runtime_key() for p in more]}
        warmed = self._warm_up(more, site, eager)  # a new split count may need another merge kernel, a twin a kernel
        if "warm_up_s" in warmed:
            extra[f"{short}_warm_up_s"] = warmed["warm_up_s"]
        started = time.perf_counter()
        # late (the twins, at most TWINS_MOST): each gets its first round however long the others took, or a twin
        # found only after the budget is compiled and then skipped (H100 at c71a713: SmolLM2's 1k static site, the
        # swap-AB winner's prefetching twin skipped at 18.1 s of tuning with 14 test processes compiling beside it)
        got, failed, _ = self._measure([by_key[best]] + list(more), site, max(end, started + SIBLINGS_S), eager,
                                       charge, first_round=1 + len(more) if late else 2)
        for key, times in got.items():
            samples.setdefault(key, []).extend(times)
        for key, error in failed.items():
            if key not in samples:
                timings[key] = error
        return extra

    def _tie_break(self, best: str, measured: dict[str, float], by_key: dict[str, Plan], site: AttentionSite,
                   span: tuple[int, ...], charge: dict[str, float], static: bool = False,
                   extra: dict[str, Any] | None = None, tie: float = TIE) -> tuple[str, dict[str, dict[str, float]]]:
        """Among the fastest and the next (up to ``TIE_MAX`` in all) within ``tie`` of it, and the fastest dense plan
        when it is within ``PEER_SPAN`` of a kernel winner (``near_peer``): the one whose worst ratio to the fastest
        of them, at the measured length and at each length of ``span``, is lowest, a kernel plan's counted
        ``PEER_MARGIN`` higher (ties: the faster where measured).
        A bucket's plan runs at every length of it, and two candidates that close swap places inside it (on the
        H100, B=64 8/8 heads D=80: split-KV measured faster at 4096 keys, cuDNN 2% faster at 2432). ``static``: the
        lengths stand for fills of a static cache (a kernel plan timed over that many keys, a dense plan keeping its
        full time). Returns the winner and the µs at each length ``{length: {key: µs}}``.

        Deciding worst ratios within 1 % by the mean over the lengths instead was tried and lost (H100, batch
        b6fd6fb): lhs04's bucket (2048, 4096] then took S=8/128 (12.47 / 12.50 / 13.29 µs at 2112 / 2880 / 4096 keys)
        over S=38/128, and S=8 ran 14.03 µs at the case's 3264 keys, where S=38 had run 13.43 (cuDNN 13.15): a plan's
        time between the lengths judged is not their interpolation."""
        pair = [k for k in sorted(measured, key=measured.get) if measured[k] <= (1 + tie) * measured[best]]
        pair = pair[:TIE_MAX]
        peer = near_peer(best, measured, by_key)
        if peer is not None and peer not in pair:
            pair.append(peer)
        if static and not reads_valid_keys(by_key[best], site):
            readers = [k for k in sorted(measured, key=measured.get) if reads_valid_keys(by_key[k], site)
                       and measured[k] <= (1 + STATIC_DENSE_TIE) * measured[best]]
            pair += [k for k in readers if k not in pair][:STATIC_READERS]
        if len(pair) < 2:
            return prefer_peer(best, measured, by_key), {}
        worst = {k: measured[k] / measured[best] for k in pair}
        at_ends: dict[str, dict[str, float]] = {}
        # a static cache's fill is timed in the cache the graph runs (``timer.at_fill``: the kernels compiled and
        # captured already, only the device valid length lower), where the timer can
        at_fill = getattr(self.timer, "at_fill", None) if static else None
        for n in dict.fromkeys(span):
            if n == site.kv_len:
                continue
            at = dataclasses.replace(site, kv_len=int(n))
            if at_fill is None:
                # the pair compiled at the measured length, not necessarily at this one (split-KV's mask-tile
                # chunking is a compile-time constant of the key count): compiled at once, as the candidates were
                warmed = self._warm_up([by_key[k] for k in pair
                                        if not (static and not reads_valid_keys(by_key[k], site))], at, False)
                if extra is not None and "warm_up_s" in warmed:
                    extra["tie_warm_up_s"] = round(extra.get("tie_warm_up_s", 0.0) + warmed["warm_up_s"], 3)
            times = {}
            for k in pair:
                if static and not reads_valid_keys(by_key[k], site):
                    times[k] = measured[k]
                    continue
                try:
                    us = at_fill(by_key[k], site, int(n)) if at_fill is not None else self.timer(by_key[k], at)
                    times[k] = float(us) + charge.get(k, 0.0)
                except Exception:  # noqa: BLE001 - an end that cannot be timed does not decide
                    times = {}
                    break
            if times and all(math.isfinite(t) and t > 0 for t in times.values()):
                fastest = min(times.values())
                for k in pair:
                    worst[k] = max(worst[k], times[k] / fastest)
                at_ends[str(n)] = times
        # a kernel plan must beat the dense plans by PEER_MARGIN in the worst case to be chosen over them
        weight = {k: 1.0 if by_key[k].kind == "dense" else 1.0 + PEER_MARGIN for k in pair}
        return min(pair, key=lambda k: (worst[k] * weight[k], measured[k])), at_ends

    def _duel(self, by_key: dict[str, Plan], site: AttentionSite, samples: dict[str, list[float]],
              charge: dict[str, float]) -> dict[str, Any]:
        """Time the candidates within ``DUEL_WITHIN`` of the fastest (``duel_keys``) ``DUEL_ROUNDS`` more times each,
        in alternating order, adding to ``samples`` (a candidate that fails now keeps what it had). Returns the
        extras to record (``duel``: the keys, ``duel_rounds``)."""
        keys = duel_keys(_charged_medians(samples, charge), by_key)
        if len(keys) < 2:
            return {}
        end, done = time.perf_counter() + DUEL_S, 0
        for r in range(DUEL_ROUNDS):
            if r > 0 and time.perf_counter() > end:
                break
            for key in (keys if r % 2 else keys[::-1]):
                try:
                    samples[key].append(float(self.timer(by_key[key], site)))
                except Exception:  # noqa: BLE001 - its earlier samples stand
                    pass
            done = r + 1
        return {"duel": keys, "duel_rounds": done}

    def _measure(self, plans: Sequence[Plan], site: AttentionSite, end: float, eager: bool = False,
                 charge: dict[str, float] | None = None,
                 first_round: int = 2) -> tuple[dict[str, list[float]], dict[str, Any], dict[str, Any]]:
        """Time ``plans`` in round-robin rounds: (µs samples per runtime key, errors and skips per key, extras).
        The first ``first_round`` plans (by default the model's pick and the first SDPA backend) always get one
        round; everything else only within the budget. A candidate that fails once is not timed again, nor one whose
        median so far, with its ``charge`` (µs added to each of its samples), is over ``PRUNE`` slower than the best's:
        round-to-round noise is a few per cent, so it cannot win, and the later rounds go to the close ones. When no
        other candidate is that close to the best the ranking is clear and no further round runs. ``eager``: a sample
        is the longer of the device time and the host time (both kept in the extras)."""
        charge = charge or {}
        samples: dict[str, list[float]] = {}
        failed: dict[str, Any] = {}
        device_us: dict[str, list[float]] = {}
        host_us: dict[str, list[float]] = {}
        rounds_done = 0
        close: set[str] | None = None
        for r in range(self.rounds):
            if r > 0 and time.perf_counter() > end:
                break
            if r > 0 and samples:
                so_far = _charged_medians(samples, charge)
                prune = PRUNE if r == 1 else PRUNE_LATE
                close = {k for k, t in so_far.items() if t <= (1 + prune) * min(so_far.values())}
                if len(close) < 2:
                    break
            for i, p in enumerate(plans):
                key = p.runtime_key()
                if key in failed or (close is not None and key not in close):
                    continue
                if (r > 0 or i >= first_round) and time.perf_counter() > end:
                    if key not in samples:
                        failed[key] = "skipped: tuning budget spent"
                    continue
                try:
                    t = float(self.timer(p, site))
                    if eager:
                        h = float(self.timer.host_us(p, site))
                        device_us.setdefault(key, []).append(t)
                        host_us.setdefault(key, []).append(h)
                        t = max(t, h)
                    samples.setdefault(key, []).append(t)
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is not a choice
                    samples.pop(key, None)
                    failed[key] = _error_text(exc)
            rounds_done = r + 1
        extra: dict[str, Any] = {"rounds": rounds_done}
        if eager:
            extra.update(device_us={k: v for k, v in device_us.items() if k in samples},
                         host_us={k: v for k, v in host_us.items() if k in samples})
        return samples, failed, extra


def duel_keys(measured: dict[str, float], by_key: dict[str, Plan]) -> list[str]:
    """The runtime keys a duel re-times (``TimingRounds._duel``): those within ``DUEL_WITHIN`` of the fastest of
    ``measured`` (µs with their charge), fastest first, at most ``TIE_MAX``, and the fastest dense plan where it is
    within ``DUEL_WITHIN`` but not among them; one key or none when nothing is that close."""
    if not measured:
        return []
    fastest = min(measured.values())
    near = [k for k in sorted(measured, key=measured.get) if measured[k] <= (1 + DUEL_WITHIN) * fastest]
    keys = near[:TIE_MAX]
    dense = next((k for k in near if by_key[k].kind == "dense"), None)
    if dense is not None and dense not in keys:
        keys.append(dense)
    return keys


def _fresh_key(plan: Plan, site: AttentionSite) -> tuple:
    """The plan and the site apart from its KV length: what ``Tuner._fresh`` keeps a fresh-length probe by."""
    return (plan.runtime_key(), site.batch, site.q_heads, site.kv_heads, site.head_dim, site.q_len, site.dtype,
            site.mask_kind)


def _median(xs: Sequence[float]) -> float:
    import statistics

    return float(statistics.median(xs))
