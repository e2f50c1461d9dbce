"""The measured choice's persistent cache: what a measurement is keyed by and the file that keeps it.

A record holds where its environment (device, driver, torch, triton and attnopt versions, and ``TUNING_VERSION``,
bumped whenever the way of measuring changes so that older measurements are not reused) and its shape
(``ShapeKey``) are equal. The file is ``<user cache>/attnopt/tuning/tuning.json`` (``$ATTNOPT_CACHE_DIR/tuning``
when set); writers replace it atomically (temporary file + ``os.replace``); a corrupt file is reported in one
warning line and treated as empty. ``attnopt.tuning`` chooses and re-exports these names.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .site import AttentionSite

#: 2: valid length outside the timed region and charged per sharing site, round-robin medians, L2-sized
#: rotation (version 1 charged every kernel plan a whole valid-length computation and picked cuDNN for it).
#: 4: static caches timed full (``timer.STATIC_FILL``), a bucket timed at its middle (``bucket_length``), the most
#: parallel kernel plan always a candidate, rounds stopped once one candidate is clearly ahead, near ties judged
#: over a bucket's ends or at a static cache's low fill.
#: 5: the budget counts the timing after the warm-up (every compiled candidate is timed), late buckets time what is
#: compiled, a kernel plan must beat the fastest dense plan by ``tuning.PEER_MARGIN``, and a dense plan within
#: ``tuning.PEER_SPAN`` of a bucket's kernel winner is judged at the bucket's ends.
#: 6: the timed call returns the op's layout (``ops.fake_layout``), a static cache's dense winner is judged against
#: several valid-key plans at the low fill, and a symbolic length's cuDNN plan is charged what a new length costs.
#: 7: a dense plan converted a bool mask in one kernel (``strategies.dense.additive_mask``): dense timings with a mask
#: changed.
#: 8: that conversion is gone again (on the H100 its -inf rows made cuDNN's and SDPA's auto output differ from SDPA
#: with the bool mask on a row with no visible key): dense timings with a mask are SDPA's own again.
#: 9: the direct launcher keyed a positional ``tl.constexpr`` (the kernels' head dims) by Triton's int specialisation
#: before 68981a5, so in a process that had run another head dim of the same padded width (80, 96, 128) a candidate
#: could be timed with a kernel compiled for the other head dim; split-KV grids may follow the cache's length
#: (``SplitKVPlan.tiles_per_split``). Records from before are dropped.
#: 10: every timed replay waits behind a GPU sleep (``bench.common.REPLAY_PREROLL_MS``); before, a replay timed after
#: a sync also counted the host's launch of the graph per call, more for candidates with more host time per call (a
#: graph of fewer calls).
#: 11: the hint's bucket of a symbolic length is timed at the hint, the other grids of the fastest configurations
#: are timed too, and without a valid length the TMA kernels run the tile crossing N in their pipelined loop.
#: 12: candidates within 2 % after the rounds are re-timed in alternating order (the duel), the third round times only
#: those within 5 % after two, and a call of a millisecond or more is timed in a graph of fewer calls, fewer replays.
#: 13: a host time (the default mode's eager choice) is timed over at most HOST_CALLS input sets (was all of them,
#: up to 256: a sample of 1024 calls).
#: 14: after the grid siblings, the grids of further close configurations nearest the fastest plan's and the fastest
#: plan's twins (L2 prefetch, head chunks) are timed; a configuration's siblings include its one-split grid.
TUNING_VERSION = 14

log = logging.getLogger("attnopt.tuning")


# --------------------------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class ShapeKey:
    """What a measurement depends on besides the environment. ``kv_len`` is the exact length, or the length a
    bucket is timed at (``tuning.bucket_length``) when ``bucketed``."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    q_len: int
    kv_len: int
    bucketed: bool
    dtype: str
    mask_kind: str
    valid_length: bool
    is_causal: bool
    #: Sites sharing one valid-length computation (0 where the site has no valid-length or arbitrary mask).
    valid_len_sharing: int = 0
    #: Whether the graph replays as CUDA graphs (else a call's host time counts too).
    graphed: bool = True
    #: Keys shared by every row (``AttentionSite.shared_prefix``): a cascade site measures differently from a plain
    #: site of the same shape. Left out of the key when None.
    shared_prefix: int | None = None
    #: The attention variant (``AttentionSite.variant_str``: ``window=4096``, ``softcap=50``, ``alibi``): a window
    #: site reads its band, not the cache, so it measures unlike a plain site of the same shape (which SDPA may
    #: win). Left out of the key when None.
    variant: str | None = None

    @classmethod
    def of(cls, site: AttentionSite, kv_len: int, bucketed: bool, valid_len_sharing: int = 1,
           graphed: bool = True) -> "ShapeKey":
        masked = site.mask_kind in ("valid_length", "arbitrary")
        return cls(batch=int(site.batch), q_heads=site.q_heads, kv_heads=site.kv_heads, head_dim=site.head_dim,
                   v_head_dim=site.v_head_dim or site.head_dim, q_len=int(site.q_len), kv_len=int(kv_len),
                   bucketed=bucketed, dtype=site.dtype, mask_kind=site.mask_kind, valid_length=masked,
                   is_causal=site.is_causal, valid_len_sharing=max(1, int(valid_len_sharing)) if masked else 0,
                   graphed=bool(graphed), shared_prefix=site.shared_prefix, variant=site.variant_str() or None)


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        return next((w for w in words if w[:1].isdigit() and "." in w), "unknown")
    except OSError:
        return "unknown"


def environment_key(device_index: int | None = None) -> dict[str, str]:
    """Device name, driver, torch, triton and attnopt versions: a measurement holds only where all are equal."""
    import torch

    from . import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device() if device_index is None else device_index)
    return {"device": device, "driver": _driver_version(), "torch": torch.__version__, "triton": triton_version,
            "attnopt": __version__, "tuning": str(TUNING_VERSION)}


def cache_path() -> Path:
    """``$ATTNOPT_CACHE_DIR/tuning/tuning.json``, else under ``platformdirs.user_cache_dir("attnopt")``."""
    from .hardware import profile_cache_dir  # the one place that resolves attnopt's cache root

    return profile_cache_dir().parent / "tuning" / "tuning.json"


# --------------------------------------------------------------------------------------------- the cache
class TuningCache:
    """Measured choices, one JSON object ``{key: record}`` in one file; ``key`` = environment + shape."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_path()
        self._warned = False
        self._warned_write = False

    @staticmethod
    def key(env: dict[str, str], shape: ShapeKey) -> str:
        fields = {k: v for k, v in dataclasses.asdict(shape).items()
                  if k not in ("shared_prefix", "variant") or v is not None}
        return json.dumps({"env": env, "shape": fields}, sort_keys=True)

    def load(self) -> dict[str, Any]:
        """Every record; ``{}`` when the file is missing or corrupt (then one warning line names the file)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._warn(exc)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("records"), dict):
                raise ValueError("not an attnopt tuning cache")
            return data["records"]
        except ValueError as exc:
            self._warn(exc)
            return {}

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("attnopt: ignoring the unreadable tuning cache %s (%s: %s); tuning again",
                        self.path, type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")

    def get(self, env: dict[str, str], shape: ShapeKey) -> dict[str, Any] | None:
        return self.load().get(self.key(env, shape))

    def save(self, env: dict[str, str], shape: ShapeKey, record: dict[str, Any]) -> bool:
        """``put``, but a file that cannot be written (read-only home, full disk) costs one warning line, not the
        compile: the measurement still holds for this process's choice. Returns whether it was written."""
        try:
            self.put(env, shape, record)
            return True
        except OSError as exc:
            if not self._warned_write:
                self._warned_write = True
                log.warning("attnopt: cannot write the tuning cache %s (%s); measurements are not kept", self.path, exc)
            return False

    def put(self, env: dict[str, str], shape: ShapeKey, record: dict[str, Any]) -> None:
        """Add one record: re-read the file, merge, write a temporary file beside it, ``os.replace`` it in (atomic,
        so a concurrent reader sees the old or the new file, never a torn one; the last writer's merge wins)."""
        records = self.load()
        records[self.key(env, shape)] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": TUNING_VERSION, "records": records}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
