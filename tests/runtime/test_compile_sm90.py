"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python semantics but never its compiler pipeline (layouts, TTGIR lowering, ptxas),
so a kernel change that is right in the interpreter can still fail to compile on the GPU. This test runs the
split-KV (with and without its fused merge), merge, stream-K and SAAP kernels in the interpreter to record the exact
launches (signature, constexprs, warps, stages), then compiles each launch for ``cuda:90`` with the Triton here
(its bundled ptxas), in a subprocess without ``TRITON_INTERPRET``.

Not covered: the tensor-descriptor (TMA) variants, which the interpreter never launches, and anything at run time
(races, numerics): the CUDA tests do that on a GPU.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
from attnopt.runtime.kernels.stream_k import stream_k_decode, stream_k_workspace

triton = pytest.importorskip("triton")

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages")


def _signature(interp, args, kwargs) -> tuple[dict, dict]:
    """Triton's signature strings and constexpr values of one interpreted launch."""
    import inspect

    params = inspect.signature(interp.fn).parameters
    annotations = interp.fn.__annotations__
    values = dict(zip(interp.arg_names, args))
    values.update(kwargs)
    sig, consts = {}, {}
    for name in interp.arg_names:
        value = values.get(name, params[name].default)
        if "constexpr" in str(annotations.get(name, "")) or value is None:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{interp.fn.__name__}.{name}: cannot type a {type(value).__name__}")
    return sig, consts


def _launches(monkeypatch) -> list[dict]:
    """Run the kernels in the interpreter on small fp16/fp32 inputs and record each distinct launch."""
    from triton.runtime.interpreter import InterpretedFunction

    recorded: dict[tuple, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launch = {k: v for k, v in kwargs.items() if k not in _OPTIONS + ("num_ctas", "launch_pdl", "maxnreg")}
        sig, consts = _signature(self, args, launch)
        key = (self.fn.__module__, self.fn.__name__, json.dumps(sig, sort_keys=True),
               json.dumps(consts, sort_keys=True, default=str))
        recorded.setdefault(key, {"module": self.fn.__module__, "name": self.fn.__name__, "sig": sig,
                                  "consts": consts, "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}})
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    B, Hq, Hkv, L, N, D = 1, 4, 2, 2, 300, 64
    for dtype in (torch.float16, torch.float32):
        q, k, v = (torch.randn(B, h, n, D, dtype=dtype) for h, n in ((Hq, L), (Hkv, N), (Hkv, N)))
        mask = torch.rand(B, 1, L, N) > 0.3
        for fused in (False, True):
            out, lse = torch.empty(B, Hq, L, D, dtype=dtype), torch.empty(B, Hq, L)
            split_kv_decode(q, k, v, out, lse, workspace=split_kv_workspace(4, q, k, v), attn_mask=mask,
                            valid_len=torch.tensor([250], dtype=torch.int32), scale=0.125, num_splits=4, block_n=64,
                            num_warps=4, num_stages=3, fused_merge=fused)
        out, lse = torch.empty(B, Hq, L, D, dtype=dtype), torch.empty(B, Hq, L)
        stream_k_decode(q, k, v, out, lse, workspace=stream_k_workspace(8, q, k, v),
                        attn_mask=torch.where(mask, 0.0, float("-inf")), scale=0.125, grid=8, block_n=64,
                        num_warps=4, num_stages=3)
        # a distributed decode's local state: the row max and log l apart, as two planes (one split, a merge launch,
        # stream-K)
        for splits in (1, 4):
            split_kv_decode(q, k, v, torch.empty(B, Hq, L, D), torch.empty(2, B, Hq, L), attn_mask=mask, scale=0.125,
                            num_splits=splits, block_n=64, num_warps=4, num_stages=3)
        stream_k_decode(q, k, v, torch.empty(B, Hq, L, D), torch.empty(2, B, Hq, L), attn_mask=mask, scale=0.125,
                        grid=8, block_n=64, num_warps=4, num_stages=3)
        # the head dim in two chunks (D=80: 64 + 16): one split, four with the fused merge, the mask-tile path
        q80, k80, v80 = (torch.randn(B, h, n, 80, dtype=dtype) for h, n in ((Hq, L), (Hkv, N), (Hkv, N)))
        for splits, fused, m in ((1, False, None), (4, True, None), (4, False, mask)):
            split_kv_decode(q80, k80, v80, torch.empty(B, Hq, L, 80, dtype=dtype), torch.empty(B, Hq, L),
                            valid_len=torch.tensor([250], dtype=torch.int32), attn_mask=m, num_splits=splits,
                            block_n=64, num_warps=4, num_stages=3, fused_merge=fused, head_chunks=True)
        stream_k_decode(q80, k80, v80, torch.empty(B, Hq, L, 80, dtype=dtype), torch.empty(B, Hq, L),
                        workspace=stream_k_workspace(8, q80, k80, v80), grid=8, block_n=64, num_warps=4, num_stages=3,
                        head_chunks=True)
        # the long-context launch variants: the merge over shares of Dv ("auto"), stream-K's merge as a second launch
        split_kv_decode(q80, k80, v80, torch.empty(B, Hq, L, 80, dtype=dtype), torch.empty(B, Hq, L),
                        workspace=split_kv_workspace(66, q80, k80, v80), num_splits=66, block_n=64, num_warps=4,
                        num_stages=3, head_chunks=True, merge_dv_split="auto", chain=True)
        stream_k_decode(q, k, v, torch.empty(B, Hq, L, D, dtype=dtype), torch.empty(B, Hq, L), attn_mask=mask,
                        scale=0.125, grid=8, block_n=64, num_warps=4, num_stages=3, merge_launch=True)
        for clusters, probes in ((32, 5), (2048, 100)):  # the bench's largest table: 2048 clusters per KV head
            _saap_launch(q, k, v, clusters, probes)
        _variant_launches(q, k, v, mask)
        if dtype == torch.float16:  # swap-AB (tile_ops: 16-bit only when compiled), padded and in head chunks
            for qq, kk, vv, chunks in ((q, k, v, False), (q80, k80, v80, True)):
                split_kv_decode(qq, kk, vv, torch.empty(qq.shape, dtype=dtype), torch.empty(B, Hq, L),
                                workspace=split_kv_workspace(4, qq, kk, vv), num_splits=4, block_n=64, num_warps=4,
                                num_stages=3, head_chunks=chunks, swap_ab=True)
    return list(recorded.values())


def _variant_launches(q, k, v, mask):
    """The variant paths (HAS_START: a window's key start read on device; SOFTCAP; ALIBI), alone and together, in
    both kernels."""
    from attnopt.runtime.kernels import valid_len
    from attnopt.runtime.kernels.valid_len import key_range_from_mask, key_start_from_mask, valid_len_from_mask

    B, Hq, L, D = q.shape
    long = torch.ones(1, 1, 1, 20000, dtype=torch.bool)  # rows past ATOMIC_CHUNK_N: the chunked paths
    counters = valid_len.arrival_counters
    try:
        for fold in ("arrive", "atomic"):  # the last program to arrive folds the chunks; without counters, atomics
            valid_len.arrival_counters = counters if fold == "arrive" else (lambda device, batch: None)
            for m in (mask, torch.where(mask, 0.0, float("-inf")), long):  # the mask reductions the window path runs
                valid_len_from_mask(m, B)
                key_start_from_mask(m, B)
                key_range_from_mask(m, B)
    finally:
        valid_len.arrival_counters = counters
    start, valid = torch.tensor([70], dtype=torch.int32), torch.tensor([250], dtype=torch.int32)
    slopes = torch.rand(Hq)
    for key_start, softcap, alibi in ((start, 0.0, None), (None, 50.0, None), (start, 50.0, slopes),
                                      (None, 0.0, slopes)):
        out, lse = torch.empty(B, Hq, L, D, dtype=q.dtype), torch.empty(B, Hq, L)
        split_kv_decode(q, k, v, out, lse, workspace=split_kv_workspace(4, q, k, v), attn_mask=mask, valid_len=valid,
                        scale=0.125, num_splits=4, block_n=64, num_warps=4, num_stages=3,
                        key_start=key_start, softcap=softcap, alibi_slopes=alibi)
        stream_k_decode(q, k, v, out, lse, workspace=stream_k_workspace(8, q, k, v), attn_mask=mask, valid_len=valid,
                        scale=0.125, grid=8, block_n=64, num_warps=4, num_stages=3, key_start=key_start,
                        softcap=softcap, alibi_slopes=alibi)


def _saap_launch(q, k, v, clusters, probes):
    """The SAAP launches over a random CSR table (some clusters empty), 4 splits: given scores, then the device
    scoring by centroids (de-roped and rotated) and by a query MLP, with the selectivity counter."""
    from attnopt.runtime.kernels.saap import saap_decode_kernel
    from attnopt.runtime.kernels.saap_select import SaapScorer

    B, Hkv, N, D = k.shape
    perm = torch.randperm(N - 40, dtype=torch.int32).add_(1).expand(B, Hkv, -1).contiguous()
    offsets = torch.linspace(0, N - 40, clusters + 1).round().to(torch.int32).expand(B, Hkv, -1).contiguous()
    hidden = 48
    mlp = (torch.randn(Hkv, hidden, D), torch.randn(Hkv, hidden), torch.rand(4, Hkv, hidden) + 0.5,
           torch.randn(Hkv, clusters, hidden), torch.randn(Hkv, clusters))
    cents, inv_freq = torch.randn(Hkv, clusters, D), torch.rand(D // 2)
    for scores, scorer in ((torch.rand(B, Hkv, clusters), None), (None, SaapScorer(cents, inv_freq, None)),
                           (None, SaapScorer(cents, None, None)), (None, SaapScorer(cents, inv_freq, mlp))):
        out = torch.empty(q.shape, dtype=q.dtype)
        saap_decode_kernel(q, k, v, offsets, perm, torch.full((B,), N - 39, dtype=torch.int32), out,
                           torch.empty(q.shape[:3]), probes=probes, sink=1, scale=0.125, scores=scores, scorer=scorer,
                           valid_len=torch.tensor([N - 10], dtype=torch.int32),
                           stats=torch.zeros(2, dtype=torch.float64), num_splits=4, block_n=64)
    if clusters == 2048:  # the plan's fused scoring-and-selection launch (its last program per head selects)
        saap_decode_kernel(q, k, v, offsets, perm, torch.full((B,), N - 39, dtype=torch.int32), out,
                           torch.empty(q.shape[:3]), probes=probes, sink=1, scale=0.125,
                           scorer=SaapScorer(cents, inv_freq, None), stats=torch.zeros(2, dtype=torch.float64),
                           num_splits=4, block_n=32, fused_select=True)


_COMPILE = textwrap.dedent("""
    import importlib, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    failures = []
    for job in json.load(sys.stdin):
        fn = getattr(importlib.import_module(job["module"]), job["name"])
        try:
            triton.compile(ASTSource(fn=fn, signature=job["sig"], constexprs=job["consts"]),
                           target=GPUTarget("cuda", 90, 32), options=job["options"])
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failures.append(f"{job['name']} {job['consts']}: {type(e).__name__}: {str(e)[:2000]}")
    print(json.dumps(failures))
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CUDA tests compile and run the kernels on this machine's GPU")
    jobs = _launches(monkeypatch)
    # the SAAP launches chained by programmatic dependent launch, which the interpreter never takes, and the
    # scoring products the GPU takes (the interpreter takes plain fp32)
    jobs += [{**j, "consts": {**j["consts"], "WAIT_PRIOR": True, "LAUNCH_DEPENDENTS": True}}
             for j in jobs if j["name"].startswith("_saap") and "WAIT_PRIOR" in j["consts"]]
    jobs += [{**j, "consts": {**j["consts"], "PRECISION": "tf32x3"}} for j in jobs if j["name"] == "_saap_rows_kernel"]
    # the long-context launches chained by programmatic dependent launch (split-KV's ``chain``, stream-K's
    # ``merge_launch``), one of each kernel: the interpreter takes none of them
    chained = {"_split_kv_kernel": {"WAIT_PRIOR": True, "LAUNCH_DEPENDENTS": True},
               "_merge_states_kernel": {"WAIT_PRIOR": True, "LAUNCH_NEXT": True},
               "_stream_k_kernel": {"LAUNCH_DEPENDENTS": True}, "_stream_k_merge_kernel": {"WAIT_PRIOR": True}}
    jobs += [{**j, "consts": {**j["consts"], **chained[j["name"]]}}
             for j in [next(j for j in jobs if j["name"] == n and (n != "_stream_k_kernel"
                                                                    or j["consts"].get("SEPARATE_MERGE")))
                       for n in chained]]
    # every attention split over both parts (saap.SHARE_SPLITS), chained as the plan runs it
    jobs += [{**j, "consts": {**j["consts"], "SHARE_ALL": True}} for j in jobs
             if j["name"] == "_saap_kernel" and j["consts"].get("WAIT_PRIOR")][:1]
    jobs += [{**j, "consts": {**j["consts"], "RADIX_BITS": bits}} for j in jobs if j["name"] == "_saap_select_kernel"
             for bits in (1, 2)]  # the selection over more than 2048 clusters
    # the selection's first round from one count, and its 32-bit keys (timing variants: saap_pieces)
    jobs += [{**j, "consts": {**j["consts"], **extra}} for j in jobs
             if j["name"] == "_saap_select_kernel" or (j["name"] == "_saap_rows_kernel" and j["consts"].get("SELECT"))
             for extra in ({"GUESS_TOP": True}, {"KEY_BITS": 32})]
    # the L2 prefetch of the tiles ahead (PTX: the interpreter never takes it), bulk and line by line, plain and
    # swap-AB
    jobs += [{**j, "consts": {**j["consts"], "PREFETCH": ahead, "PREFETCH_BULK": bulk}}
             for j in jobs if j["name"] == "_split_kv_kernel" and j["consts"].get("SWAP_AB")
             for ahead, bulk in ((3, True), (2, False))]
    assert any(j["consts"].get("SWAP_AB") and j["consts"].get("D_LO") == 64 for j in jobs)
    # the scoring launch that lets its dependents in once its logits are stored (saap_select.LATE_DEPENDENTS)
    jobs += [{**j, "consts": {**j["consts"], "LATE_DEPENDENTS": True}} for j in jobs
             if j["name"] == "_saap_rows_kernel" and j["consts"].get("SELECT") and j["consts"].get("LAUNCH_DEPENDENTS")
             ][:1]
    # the scoring reading 16-bit centroids (saap_rule.CENTROID_DTYPE; the interpreter has no bf16)
    jobs += [{**j, "sig": {**j["sig"], "w_ptr": "*bf16", "bias_ptr": "*bf16", "bn_ptr": "*bf16"}} for j in jobs
             if j["name"] == "_saap_rows_kernel" and j["consts"].get("LATE_DEPENDENTS")]
    assert any(j["consts"].get("SHARE_ALL") for j in jobs) and any(j["consts"].get("LATE_DEPENDENTS") for j in jobs)
    assert any(j["sig"].get("w_ptr") == "*bf16" for j in jobs)
    names = {j["name"] for j in jobs}
    assert {"_split_kv_kernel", "_merge_states_kernel", "_stream_k_kernel", "_saap_kernel", "_saap_rows_kernel",
            "_saap_select_kernel"} <= names, names
    assert {"_valid_len_kernel"} <= names and any(j["consts"].get("FIRST") for j in jobs), names
    assert any(j["consts"].get("ATOMIC") and j["consts"].get("FIRST") for j in jobs), names
    variants = {(j["name"], j["consts"].get("HAS_START"), j["consts"].get("SOFTCAP"), j["consts"].get("ALIBI"))
                for j in jobs}
    assert {n for n in ("_split_kv_kernel", "_stream_k_kernel")
            if any(j["name"] == n and j["consts"].get("D_LO") == 64 for j in jobs)} == {"_split_kv_kernel",
                                                                                        "_stream_k_kernel"}
    assert {(n, *v) for n in ("_split_kv_kernel", "_stream_k_kernel")
            for v in ((True, False, False), (False, True, False), (True, True, True), (False, False, True))} <= variants
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(jobs, default=str), text=True,
                          capture_output=True, env=env, timeout=850)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)
