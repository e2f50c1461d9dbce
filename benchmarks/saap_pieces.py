"""Each piece of a SAAP decode call timed alone, in CUDA graphs (``attnopt.bench.common.time_us``), on the
``attnopt bench saap`` inputs (llama3-8b shape, clustered synthetic keys, the index's centroids refined at prefill,
input sets rotated so that the reads miss in L2): which piece to cut, and by which variant.

Rows (µs a call, the median over graph replays of back-to-back calls):

* ``full``, ``full-unfused``, ``full-unchained``: the whole op as the plan runs it (fused selection, the launches
  chained by programmatic dependent launch; four launches apart; not chained); ``full-merge-dv<n>`` with n merge
  programs a row (``saap.MERGE_DV_SPLIT``), ``full-prefetch4`` / ``-prefetch0-kv`` / ``-prefetch4-kv`` with the
  attention's perm and K/V prefetches (``saap.PREFETCH_LINES``, ``saap.PREFETCH_KV``), ``full-S48-...`` at 48
  splits, ``-selprefetch4`` with the selection asking L2 for each chosen cluster's first perm lines
  (``saap_select.SELECT_PREFETCH_LINES``), ``full-fused-merge`` the merge in the attention launch (the plan's
  ``fused_merge``); ``full-k32`` with the selection ranking 32-bit score keys (``saap_rule.SELECT_KEY_BITS`` is the
  rule: 16; the k32 rows time another pick than the reference's, so no ``same_list``), ``full-guess`` the selection's
  first round from one count (``saap_select.GUESS_TOP``), ``full-fenced-stats`` the selectivity atomics acq_rel as
  before (each behind a fence; ``saap_select.RELAXED_STATS``), ``full-sw8w`` the fused scoring-and-selection launch
  at 8 warps with the wide chunks (``saap_select.FUSED_WIDE_MIN_WARPS``), ``full-shared`` (``-S56``, ``-S48``: at 56,
  48 splits) every attention split over a share of the sink and window and then of the clusters
  (``saap.SHARE_SPLITS``), ``-late`` the attention launch let in only once every scoring program stored its logits
  (``saap_select.LATE_DEPENDENTS``, the plan's since 8fa8292: ``full`` times it too; ``full-early`` the former way);
  ``full-c16`` / ``full-c32`` the scoring reading the centroids in bf16 / fp32 (``saap_rule.CENTROID_DTYPE``, set
  while the plan is prepared; the bench's centroids are bf16 values, so both pick the reference's set);
* ``score*``: the scoring launch alone (``saap_select(launches="scoring")``): ``-fused16`` the fused launch's
  geometry (128 clusters and 16 warps a program) without the selection, ``-own`` its own launch's (64 and 4), with
  ``-ieee`` Triton's FMA dot instead of three TF32 ones, ``-fma`` no dot (products summed in registers, the rows
  unpadded), ``-noderope`` without removing RoPE from the queries;
* ``score+select-fused16``: the plan's fused scoring-and-selection launch (``-fma``: with the "fma" products, ``-k32``
  32-bit keys, ``-guess`` the first round's digit from one count); ``score+select-fused8w`` / ``score-fused8w``: at 8
  warps with 128 clusters a program;
* ``select-w<W>``: the selection launch alone at W warps over logits precomputed in the workspace, ``-r<B>`` at B
  bits a radix round, ``-guess`` with the first round's digit from one packed count where it can (not the round),
  ``-k32`` on 32-bit score keys, ``-skip1`` without the threshold rounds, ``-skip2`` without them and the
  compaction (the ablations choose no real set: they say what each part costs);
* ``attn``: the attention launch alone over a work list the selection left (``-S<n>`` at n splits, ``-nw<n>`` at n
  warps, ``-clusters`` / ``-window`` only the splits of the chosen clusters / of the sink and window,
  ``-late-list`` with the list's first loads after the window phase, as before they went out with the query's,
  ``-fused-merge`` with the merge in it, ``-shared`` every split over a share of both parts (``saap.SHARE_SPLITS``), ``-prefetch<n>`` with each cluster split asking L2 for n lines of perm
  per list entry first (``saap.PREFETCH_LINES``), ``-clusters-nolookup`` the cluster splits at hashed positions without the list and perm reads
  (an ablation: what the lookups cost), ``-kv`` with the next tile's K/V rows prefetched into L2 once their
  positions are known (``saap.PREFETCH_KV``);
* ``merge``: the merge launch alone (``-dv<n>``: n programs a row, each over Dv / n; ``-S32``, ``-S128``: of the
  partials attn-S32 / attn-S128 left);
  ``score-fused16-l2``: one input set over and over (its centroids stay in L2); ``empty-x1``, ``empty-x3``: empty
  launches of the same grids, the floor of a launch in a graph; ``sdpa-cudnn``: dense SDPA on cuDNN over the same
  sets (the issue's peer: ``full`` against it gives the speedup of one run).

Every ``select`` and ``score+select`` variant that chooses a real set is checked to leave the same work list as the
plan's selection (``same_list``). Run on a GPU: ``python benchmarks/saap_pieces.py`` (about two minutes on an
H100); the JSON goes to ``benchmarks/results/saap-pieces-<device>.json``.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _setup(case: str, target: float, dtype, device: str = "cuda"):
    """The bench's inputs for one case: (sets, per-set SAAP state dicts, plan, scale, constants)."""
    from attnopt.bench.common import results_header
    from attnopt.bench.saap import CASES, SINK, _clustered_set, budget
    from attnopt.hardware import detect_profile
    from attnopt.runtime.saap import build_clusters, registry
    from attnopt.runtime.saap.index import synthetic_index
    from attnopt.runtime.saap.train import cluster_count
    from attnopt.runtime.strategies import PlanContext, get_strategy
    from attnopt.site import AttentionSite

    B, Hq, Hkv, D, N = CASES[case]
    C = min(2048, cluster_count(N))
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device=device).manual_seed(7)
    # bf16 values: the scoring reads the same centroids in either CENTROID_DTYPE (the -c16 / -c32 rows pick one set)
    centroids = torch.randn(Hkv, C, D, device=device, generator=gen).bfloat16().float()
    l2 = results_header("saap-pieces").get("l2_bytes") or 50 << 20
    smallest = target * N * B * Hkv * 2 * D * dtype.itemsize
    count = max(1, min(8 if device == "cuda" else 2, math.ceil(4 * l2 / smallest)))
    layers = tuple(range(1, count + 1))
    index = synthetic_index(Hq, Hkv, D, C, layers=layers, centroids=centroids.cpu())
    path = Path(tempfile.mkdtemp(prefix="attnopt-saap-pieces-")) / f"{case}.safetensors"
    index.save(path)
    window, probes = budget(target, N, C)
    registry.reset()
    ctx = PlanContext(device_type="cuda", triton_available=True, extras={
        "saap": {"index": str(path), "probes": probes, "sink": SINK, "window": window}})
    site = AttentionSite(node="bench", module_path="model.layers.1.self_attn", pattern="sdpa", batch=B, q_heads=Hq,
                         kv_heads=Hkv, head_dim=D, q_len=1, kv_len=N, dtype=str(dtype)[6:], gqa_source="enable_gqa")
    strat = get_strategy("saap")
    proto = next(iter(strat.candidates(site, detect_profile(), ctx)))
    dev_index = registry.get_index(path, device)
    sets = [_clustered_set(i, B, Hq, Hkv, D, N, centroids, index.rope, dtype, gen, device) for i in range(count)]
    for layer, s in zip(layers, sets):
        registry.set_state(path, layer, build_clusters(dev_index, layer, s["k"], N - 1, SINK, window))
    info = dict(case=case, B=B, Hq=Hq, Hkv=Hkv, D=D, N=N, C=C, probes=probes, window=window, sink=SINK,
                sets=count, splits=proto.num_splits, block_n=proto.block_n, num_stages=proto.num_stages,
                fused_select=proto.fused_select)
    return sets, layers, path, proto, scale, info


def main(argv=None) -> int:
    from dataclasses import replace

    from attnopt.bench.common import cycle, rel_err, results_header, time_us, write_results
    from attnopt.bench.kernels import plan_call
    from attnopt.runtime.kernels.merge import merge_states
    from attnopt.runtime.kernels.saap import _SAAP_LAUNCH, _attention_launch, saap_workspace, window_split_count
    from attnopt.runtime.kernels.saap_select import saap_select
    import attnopt.runtime.kernels.saap as saap_module
    import attnopt.runtime.kernels.saap_rule as saap_rule_module
    import attnopt.runtime.kernels.saap_select as saap_select_module
    from attnopt.runtime.kernels.common import decode_geometry
    from attnopt.runtime.saap import registry, saap_decode
    from attnopt.runtime.saap.decode import kernel_scorer
    from attnopt.runtime.kernels.saap_rule import scoring_centroids

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="llama3-8b-128k")
    p.add_argument("--target", type=float, default=0.05)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="", help="comma-separated row names to time, a trailing * for a prefix "
                   "(default: all)")
    p.add_argument("--dry", action="store_true", help="each piece called once on the CPU, not timed (run it under "
                   "TRITON_INTERPRET=1 with --case tiny-4k --dtype fp16: a check of this script without a GPU)")
    args = p.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("saap_pieces needs a CUDA GPU (or --dry)")
    device = "cpu" if args.dry else "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.time()
    sets, layers, path, proto, scale, info = _setup(args.case, args.target, dtype, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if args.dry:  # one call, no graph
        def time_us(fn, mode, min_calls):  # noqa: F811 - the dry run's stand-in
            fn()
            return float("nan")
    results = results_header("saap-pieces", **info)
    print(f"== {info}", flush=True)
    B, Hq, Hkv, N = info["B"], info["Hq"], info["Hkv"], info["N"]
    probes, sink, S = info["probes"], info["sink"], info["splits"]
    index = registry.get_index(path, device)
    ctx = []  # per set: everything its pieces need
    for layer, s in zip(layers, sets):
        st = registry.get_state(path, layer)
        scorer = kernel_scorer(index, layer)
        if st.centroids is not None:
            scorer = scorer._replace(centroids=st.centroids)
        ws = saap_workspace(S, s["q"], s["v"], Hkv, scorer.clusters)
        W = window_split_count(S, sink + info["window"], probes * st.perm.shape[-1] / st.num_clusters)
        out = torch.empty(s["q"].shape[:3] + (s["v"].shape[-1],), device=device, dtype=dtype)
        ctx.append(dict(s=s, st=st, scorer=scorer, ws=ws, W=W, out=out, layer=layer))
    info["window_splits"] = ctx[0]["W"]

    def select(c, **kw):
        return saap_select(c["s"]["q"], c["st"].offsets, c["st"].ends, c["ws"].select, probes=probes, scale=scale,
                           n_keys=N, sink=sink, scorer=c["scorer"], **kw)

    # the plan's work list in every set's workspace (the unfused scoring leaves the logits the selection rows read)
    for c in ctx:
        select(c)
    sync()
    plan_lists = [(c["ws"].select.incl.clone(), c["ws"].select.total.clone()) for c in ctx]

    def same_list():
        sync()
        return all(torch.equal(c["ws"].select.incl, i) and torch.equal(c["ws"].select.total, t)
                   for c, (i, t) in zip(ctx, plan_lists))

    def attention(c, splits=None, warps=4, part="all", late_list=False, fused_merge=False, **extra):
        ws = c["ws"]
        if splits is not None and splits != S:
            if f"ws{splits}" not in c:
                c[f"ws{splits}"] = saap_workspace(splits, c["s"]["q"], c["s"]["v"], Hkv,
                                                  c["scorer"].clusters)._replace(select=ws.select)
            ws = c[f"ws{splits}"]
        n = ws.num_splits
        W = window_split_count(n, sink + info["window"], probes * c["st"].perm.shape[-1] / c["st"].num_clusters)
        s = c["s"]
        geo = decode_geometry(s["q"], s["k"], s["v"])
        a, consts = _attention_launch(s["q"], s["k"], s["v"], c["st"].perm, c["st"].ends, None, c["out"], None, ws,
                                      scale, sink, W, proto.block_n, warps, proto.num_stages, fused_merge, geo)
        consts = {**consts, **extra}
        first, count = {"all": (0, n), "clusters": (W, n - W), "window": (0, W)}[part]
        grid = (B * Hkv * geo.num_m, count)
        # late_list: the list's loads after phase 1 as when chained (the wait is a no-op in an unchained launch)
        return lambda: _SAAP_LAUNCH(grid, *a, first, **consts, WAIT_PRIOR=late_list and device == "cuda",
                                    LAUNCH_DEPENDENTS=False)

    def merge(c, dv_split=1):
        ws = c["ws"]
        return lambda: merge_states(ws.o, ws.lse[0], out=c["out"], lse_out=False, log_l_parts=ws.lse[1],
                                    dv_split=dv_split)

    def flagged(call, **flags):
        """``call`` with module defaults set while it runs (``module.NAME``: value), so that a plan's whole call
        takes a variant that no plan field names."""
        def run():
            old = {key: getattr(modules[key.split(".")[0]], key.split(".")[1]) for key in flags}
            for key, value in flags.items():
                setattr(modules[key.split(".")[0]], key.split(".")[1], value)
            try:
                return call()
            finally:
                for key, value in old.items():
                    setattr(modules[key.split(".")[0]], key.split(".")[1], value)
        return run

    def cudnn(c):
        import argparse as ap

        from attnopt.bench.kernels import _peer_methods

        method = next(m for m in _peer_methods(B, Hq, Hkv, info["D"], N, None, scale,
                                               ap.Namespace(no_flex=True, no_eager_peer=True))
                      if m.name == "sdpa-cudnn")
        return method.make(dict(c["s"], mask=None))

    def prepared(make, **flags):
        """``flagged`` that also holds the flags while ``make`` prepares the call (a plan's state reads them)."""
        return flagged(flagged(make, **flags)(), **flags)

    modules = {"saap": saap_module, "select": saap_select_module, "rule": saap_rule_module}
    c16 = {"rule.CENTROID_DTYPE": torch.bfloat16}
    c32 = {"rule.CENTROID_DTYPE": torch.float32}
    dv2 = {"saap.MERGE_DV_SPLIT": 2}
    dv4 = {"saap.MERGE_DV_SPLIT": 4}
    prefetch = {"saap.PREFETCH_LINES": 4}
    kv = {"saap.PREFETCH_KV": True}
    selpf = {"select.SELECT_PREFETCH_LINES": 4}
    kv_lines = saap_module.kv_prefetch_lines(info["D"], sets[0]["k"].element_size())
    k32 = {"select.SELECT_KEY_BITS": 32}  # the 32-bit score keys (timing only: another pick than the reference's)
    wide8 = {"select.FUSED_WIDE_MIN_WARPS": 8}
    guess = {"select.GUESS_TOP": True}
    fenced = {"select.RELAXED_STATS": False}
    shared = {"saap.SHARE_SPLITS": True}
    late = {"select.LATE_DEPENDENTS": True}
    early = {"select.LATE_DEPENDENTS": False}  # as before 8fa8292: the dependents let in at the scoring's start

    dummy = torch.zeros(1, device=device)
    geo0 = decode_geometry(sets[0]["q"], sets[0]["k"], sets[0]["v"])
    empty_grids = [((B * Hkv * 16,), 16), ((B * Hkv * geo0.num_m, S), 4), ((B * Hq,), 4)]

    def empty(n):
        def call():
            for grid, warps in empty_grids[:n] if n > 1 else empty_grids[1:2]:
                _empty_kernel[grid](dummy, num_warps=warps)
        return call

    def with_centroids(c, dtype):  # the set's scorer reading its centroids in ``dtype`` (one copy a set)
        key = f"scorer-{dtype}"
        if key not in c:
            c[key] = c["scorer"]._replace(centroids=scoring_centroids(c["scorer"].centroids, dtype))
        return dict(c, scorer=c[key])

    def noderope(c):
        return dict(c, scorer=c["scorer"]._replace(inv_freq=None))

    plans = [replace(proto, index=str(path), layer=layer) for layer in layers]
    rows_spec = [
        ("full", lambda c, i: plan_call(plans[i], c["s"], scale)),
        ("full-unfused", lambda c, i: plan_call(replace(plans[i], fused_select=False), c["s"], scale)),
        ("full-unchained", lambda c, i: plan_call(replace(plans[i], pdl=False), c["s"], scale)),
        ("full-merge-dv4", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **dv4)),
        ("full-merge-dv2", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **dv2)),
        ("full-prefetch4", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **prefetch)),
        ("full-prefetch0-kv", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **kv)),
        ("full-prefetch4-kv", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **prefetch, **kv)),
        ("full-merge-dv2-prefetch4-kv", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **dv2, **prefetch,
                                                              **kv)),
        ("full-selprefetch4", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **selpf)),
        ("full-selprefetch4-prefetch4-kv", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **selpf,
                                                                 **prefetch, **kv)),
        ("full-merge-dv2-selprefetch4-prefetch4-kv", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **dv2,
                                                                           **selpf, **prefetch, **kv)),
        ("full-S48-merge-dv2-prefetch4-kv", lambda c, i: flagged(plan_call(replace(plans[i], num_splits=48), c["s"],
                                                                           scale), **dv2, **prefetch, **kv)),
        ("full-fused-merge", lambda c, i: plan_call(replace(plans[i], fused_merge=True), c["s"], scale)),
        ("full-k32", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **k32)),
        ("full-guess", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **guess)),
        ("full-k32-guess", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **k32, **guess)),
        ("full-guess-selprefetch4", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **guess, **selpf)),
        ("full-S56", lambda c, i: plan_call(replace(plans[i], num_splits=56), c["s"], scale)),
        ("full-S72", lambda c, i: plan_call(replace(plans[i], num_splits=72), c["s"], scale)),
        ("full-fenced-stats", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **fenced)),
        ("full-sw8w", lambda c, i: flagged(plan_call(replace(plans[i], select_warps=8), c["s"], scale), **wide8)),
        ("full-sw8w-k32", lambda c, i: flagged(plan_call(replace(plans[i], select_warps=8), c["s"], scale), **wide8,
                                                **k32)),
        ("full-shared", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **shared)),
        ("full-shared-S56", lambda c, i: flagged(plan_call(replace(plans[i], num_splits=56), c["s"], scale),
                                                 **shared)),
        ("full-shared-S48", lambda c, i: flagged(plan_call(replace(plans[i], num_splits=48), c["s"], scale),
                                                 **shared)),
        ("full-early", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **early)),
        ("full-late", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **late)),
        ("full-shared-late", lambda c, i: flagged(plan_call(plans[i], c["s"], scale), **shared, **late)),
        ("full-c16", lambda c, i: prepared(lambda: plan_call(plans[i], c["s"], scale), **c16)),
        ("full-c32", lambda c, i: prepared(lambda: plan_call(plans[i], c["s"], scale), **c32)),
        ("empty-x1", lambda c, i: empty(1)),
        ("empty-x3", lambda c, i: empty(3)),
        ("score+select-fused16", lambda c, i: lambda: select(c, fused=True, num_warps=16)),
        ("score-fused16", lambda c, i: lambda: select(c, fused=True, num_warps=16, launches="scoring")),
        ("score-fused16-c16", lambda c, i: lambda: select(with_centroids(c, torch.bfloat16), fused=True, num_warps=16,
                                                          launches="scoring")),
        ("score+select-fused16-c16", lambda c, i: lambda: select(with_centroids(c, torch.bfloat16), fused=True,
                                                                 num_warps=16)),
        ("score+select-fused16-k32", lambda c, i: lambda: select(c, fused=True, num_warps=16, key_bits=32)),
        ("score+select-fused16-guess", lambda c, i: lambda: select(c, fused=True, num_warps=16, guess_top=True)),
        ("score+select-fused8w", lambda c, i: flagged(lambda: select(c, fused=True, num_warps=8), **wide8)),
        ("score-fused8w", lambda c, i: flagged(lambda: select(c, fused=True, num_warps=8, launches="scoring"),
                                               **wide8)),
        ("score-fused16-ieee", lambda c, i: lambda: select(c, fused=True, num_warps=16, launches="scoring",
                                                         precision="ieee")),
        ("score-fused16-fma", lambda c, i: lambda: select(c, fused=True, num_warps=16, launches="scoring",
                                                        precision="fma")),
        ("score+select-fused16-fma", lambda c, i: lambda: select(c, fused=True, num_warps=16, precision="fma")),
        ("score-fused16-noderope", lambda c, i: lambda: select(noderope(c), fused=True, num_warps=16,
                                                             launches="scoring")),
        ("score-fused8", lambda c, i: lambda: select(c, fused=True, num_warps=8, launches="scoring")),
        ("score-own", lambda c, i: lambda: select(c, launches="scoring")),
        ("score-own-ieee", lambda c, i: lambda: select(c, launches="scoring", precision="ieee")),
        ("score-own-fma", lambda c, i: lambda: select(c, launches="scoring", precision="fma")),
        ("score-own-noderope", lambda c, i: lambda: select(noderope(c), launches="scoring")),
        # the selection rows read the logits the unfused scoring left: restore them first (the fused rows above
        # wrote their chunk statistics in the fused launch's layout)
        ("select-w4", lambda c, i: lambda: select(c, launches="selection", num_warps=4)),
        ("select-w8", lambda c, i: lambda: select(c, launches="selection", num_warps=8)),
        ("select-w16", lambda c, i: lambda: select(c, launches="selection", num_warps=16)),
        ("select-w16-r2", lambda c, i: lambda: select(c, launches="selection", num_warps=16, radix=2)),
        ("select-w16-r8", lambda c, i: lambda: select(c, launches="selection", num_warps=16, radix=8)),
        ("select-w8-r8", lambda c, i: lambda: select(c, launches="selection", num_warps=8, radix=8)),
        ("select-w16-guess", lambda c, i: lambda: select(c, launches="selection", num_warps=16, guess_top=True)),
        ("select-w16-k32", lambda c, i: lambda: select(c, launches="selection", num_warps=16, key_bits=32)),
        ("select-w16-k32-guess", lambda c, i: lambda: select(c, launches="selection", num_warps=16, key_bits=32,
                                                            guess_top=True)),
        ("select-w8-k32", lambda c, i: lambda: select(c, launches="selection", num_warps=8, key_bits=32)),
        ("select-w16-skip1", lambda c, i: lambda: select(c, launches="selection", num_warps=16, skip=1)),
        ("select-w16-skip2", lambda c, i: lambda: select(c, launches="selection", num_warps=16, skip=2)),
        # the attention and merge rows read the plan's work list, restored before them
        ("attn", lambda c, i: attention(c)),
        ("attn-late-list", lambda c, i: attention(c, late_list=True)),
        ("attn-fused-merge", lambda c, i: attention(c, fused_merge=True)),
        ("attn-prefetch2", lambda c, i: attention(c, PREFETCH_LINES=2)),
        ("attn-prefetch4", lambda c, i: attention(c, PREFETCH_LINES=4)),
        ("attn-clusters-prefetch4", lambda c, i: attention(c, part="clusters", PREFETCH_LINES=4)),
        ("attn-clusters-nolookup", lambda c, i: attention(c, part="clusters", NO_LOOKUP=True)),
        ("attn-prefetch4-kv", lambda c, i: attention(c, PREFETCH_LINES=4, KV_LINES=kv_lines)),
        ("attn-prefetch0-kv", lambda c, i: attention(c, KV_LINES=kv_lines)),
        ("attn-clusters-prefetch4-kv", lambda c, i: attention(c, part="clusters", PREFETCH_LINES=4,
                                                               KV_LINES=kv_lines)),
        ("attn-S48-prefetch4-kv", lambda c, i: attention(c, splits=48, PREFETCH_LINES=4, KV_LINES=kv_lines)),
        ("attn-shared", lambda c, i: attention(c, SHARE_ALL=True)),
        ("attn-clusters", lambda c, i: attention(c, part="clusters")),
        ("attn-window", lambda c, i: attention(c, part="window")),
        ("attn-S32", lambda c, i: attention(c, splits=32)),
        ("attn-S128", lambda c, i: attention(c, splits=128)),
        ("attn-nw2", lambda c, i: attention(c, warps=2)),
        ("attn-S128-nw2", lambda c, i: attention(c, splits=128, warps=2)),  # one wave at 8 programs an SM
        ("merge", lambda c, i: merge(c)),
        ("merge-dv2", lambda c, i: merge(c, dv_split=2)),
        ("merge-dv4", lambda c, i: merge(c, dv_split=4)),
        ("merge-dv8", lambda c, i: merge(c, dv_split=8)),
        ("merge-S32", lambda c, i: merge(dict(c, ws=c["ws32"]))),  # the partials attn-S32 left
        ("merge-S128", lambda c, i: merge(dict(c, ws=c["ws128"]))),
        ("sdpa-cudnn", lambda c, i: cudnn(c)),  # the dense peer the targets are against, same sets
        # one input set over and over: the centroids stay in L2 (what the rotation's HBM reads cost the scoring)
        ("score-fused16-l2", lambda c, i: lambda: select(ctx[0], fused=True, num_warps=16, launches="scoring")),
    ]
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    want, _, sel = saap_decode(index, layers[0], registry.get_state(path, layers[0]), sets[0]["q"], sets[0]["k"],
                               sets[0]["v"], probes, scale)
    info["selectivity"] = float(sel)
    restored = {"select": False, "attn": False}
    for name, make in rows_spec:
        if only and not any(name == o or (o.endswith("*") and name.startswith(o[:-1])) for o in only):
            continue
        row = {"piece": name}
        try:
            if name.startswith(("select", "attn", "merge")):
                for c in ctx:  # the unfused logits and the plan's work list, as the timed rows expect them
                    select(c)
                sync()
            calls = [make(c, i) for i, c in enumerate(ctx)]
            res = calls[0]()
            sync()
            if name.startswith("full"):
                row["rel_err"] = rel_err(res.float(), want.float())
            if name.startswith(("select", "score+select")) and "skip" not in name and "k32" not in name:
                for call in calls[1:]:
                    call()
                row["same_list"] = same_list()
            row["us"] = time_us(cycle(calls), "graph", min_calls=len(calls))
        except Exception as exc:  # noqa: BLE001 - one failing piece must not lose the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            sync()
        results["rows"].append(row)
        extra = "".join(f" {k} {row[k]}" for k in ("same_list", "rel_err") if k in row)
        print(f"  {name:<26} " + (f"{row['us']:7.2f} µs{extra}" if "us" in row else row["error"]), flush=True)
    results["elapsed_s"] = round(time.time() - t0, 1)
    out = args.out or f"benchmarks/results/saap-pieces-{results['device'].replace(' ', '-').lower()}.json"
    write_results(out, results)
    print(f"wrote {out} ({results['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
