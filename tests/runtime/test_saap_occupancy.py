"""The SAAP kernels' sm_90 resources at the bench's llama3-8b shape, compiled on a machine without a GPU.

The plan's geometry rests on them: the attention's gathered reads are latency-bound, so the split count aims at
``PROGRAMS_PER_SM`` programs per SM, which are resident in one wave only if that many fit the SM's registers and
shared memory at the plan's ``BLOCK_N``; the selection runs one program per head and must not spill. The launches
are recorded in the interpreter, specialised as the JIT does (integers equal to 1 become constants, pointers and
multiples of 16 get their divisibility) and compiled for ``cuda:90`` with the bundled ptxas; ``cuobjdump
-res-usage`` reads the registers, the spill stack and the static shared memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the sibling compile test's launch recording
from test_compile_sm90 import _OPTIONS, _signature  # noqa: E402

triton = pytest.importorskip("triton")

#: An H100's registers per SM and its shared memory per SM (bytes).
SM_REGISTERS = 65536
SM_SHARED = 228 * 1024

_COMPILE = textwrap.dedent("""
    import importlib, json, os, re, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = {}
    for job in json.load(sys.stdin):
        fn = getattr(importlib.import_module(job["module"]), job["name"])
        ck = triton.compile(ASTSource(fn=fn, signature=job["sig"], constexprs=job["consts"],
                                      attrs={(i,): [["tt.divisibility", 16]] for i in job["div"]}),
                            target=GPUTarget("cuda", 90, 32), options=job["options"])
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        regs, stack = (int(re.search(name + r":(\\d+)", usage).group(1)) for name in ("REG", "STACK"))
        out[job["name"]] = {"regs": regs, "stack": stack, "shared": ck.metadata.shared,
                            "threads": 32 * job["options"]["num_warps"],
                            "prefetches": ck.asm["ptx"].count("prefetch.global.L2")}
    print(json.dumps(out))
""")


def _record(monkeypatch, block_n: int, fused: bool = False) -> list[dict]:
    """The attention and selection launches of one centroid-scored call, 32/8 heads, D=128, 2048 clusters, with the
    JIT's specialisation; the attention's inputs typed bf16 as on the GPU (the interpreter ran fp16)."""
    from triton.runtime.interpreter import InterpretedFunction

    from attnopt.runtime.kernels.saap import saap_decode_kernel
    from attnopt.runtime.kernels.saap_select import SaapScorer

    recorded: dict[str, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launch = {k: v for k, v in kwargs.items() if k not in _OPTIONS + ("num_ctas", "launch_pdl", "maxnreg")}
        sig, consts = _signature(self, args, launch)
        values = dict(zip(self.arg_names, args), **launch)
        div = []
        for i, name in enumerate(self.arg_names):
            if sig[name] in ("i32", "i64") and values[name] == 1:
                sig[name], consts[name] = "constexpr", 1
            elif sig[name].startswith("*") or (sig[name] in ("i32", "i64") and values[name] % 16 == 0):
                div.append(i)
        recorded.setdefault(self.fn.__name__, {"module": self.fn.__module__, "name": self.fn.__name__, "sig": sig,
                                               "consts": consts, "div": div,
                                               "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}})
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    B, Hq, Hkv, N, D, C = 1, 32, 8, 4096, 128, 2048
    q, k, v = (torch.randn(B, h, n, D, dtype=torch.float16) for h, n in ((Hq, 1), (Hkv, N), (Hkv, N)))
    perm = torch.randperm(N - 40, dtype=torch.int32).add_(1).expand(B, Hkv, -1).contiguous()
    offsets = torch.linspace(0, N - 40, C + 1).round().to(torch.int32).expand(B, Hkv, -1).contiguous()
    saap_decode_kernel(q, k, v, offsets, perm, torch.full((B,), N - 39, dtype=torch.int32), torch.empty_like(q),
                       probes=100, sink=1, scale=D ** -0.5, scorer=SaapScorer(torch.randn(Hkv, C, D),
                                                                               torch.rand(D // 2), None),
                       stats=torch.zeros(2, dtype=torch.float64), num_splits=8, block_n=block_n, fused_select=fused,
                       fused_merge=fused)
    # fused, the selection runs in the scoring launch (its last program per head)
    names = ("_saap_kernel", "_saap_rows_kernel") if fused else ("_saap_kernel", "_saap_select_kernel",
                                                                  "_saap_rows_kernel")
    jobs = [recorded[name] for name in names]
    for name in ("q_ptr", "k_ptr", "v_ptr"):
        jobs[0]["sig"][name] = "*bf16"
    jobs[0]["consts"].update(UPCAST=False, PRECISION="tf32")
    if fused:  # the GPU launch of the fused merge caps its registers (the interpreter's launch takes no cap)
        jobs[0]["options"]["maxnreg"] = 128
    for job in jobs[1:]:
        if job["name"] == "_saap_rows_kernel":  # the GPU's scoring products (the interpreter ran "ieee")
            from attnopt.runtime.kernels.saap_select import block_rows_for, scoring_precision

            precision = scoring_precision(Hq // Hkv)
            job["consts"].update(PRECISION=precision, BLOCK_R=block_rows_for(Hq // Hkv, precision))
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
def test_attention_fits_its_programs_per_sm_and_the_selection_does_not_spill(monkeypatch, fused):
    if torch.cuda.is_available():
        pytest.skip("the CUDA tests run the kernels on this machine's GPU")
    from attnopt.runtime.strategies.saap import BLOCK_N, PROGRAMS_PER_SM

    jobs = _record(monkeypatch, BLOCK_N, fused)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(jobs, default=str), text=True,
                          capture_output=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    usage = json.loads(proc.stdout.strip().splitlines()[-1])
    attn, select = usage["_saap_kernel"], usage["_saap_rows_kernel" if fused else "_saap_select_kernel"]
    per_program_regs = -(-attn["regs"] // 8) * 8 * attn["threads"]  # allocated 8 registers at a time per thread
    # the scoring's fp32 sin/cos keep libdevice's slow-path reduction array on the stack (32 bytes; never used: the
    # angles are reduced in fp64 first); beyond it, nothing spills (fused: the selection in the scoring launch)
    trig = usage["_saap_rows_kernel"]["stack"]
    assert trig <= 32, usage
    assert attn["stack"] == 0 and select["stack"] == (trig if fused else 0), usage
    if fused:  # the scoring launch (8 heads x 16 chunks of the 2048 clusters) runs in one wave on 132 SMs
        from attnopt.runtime.kernels.saap_select import BLOCK_LOGITS_Q_FUSED

        scoring = usage["_saap_rows_kernel"]
        per_sm = min(SM_REGISTERS // (-(-scoring["regs"] // 8) * 8 * scoring["threads"]),
                     SM_SHARED // (scoring["shared"] + 1024))
        assert 132 * per_sm >= 8 * -(-2048 // BLOCK_LOGITS_Q_FUSED), usage
    assert PROGRAMS_PER_SM * per_program_regs <= SM_REGISTERS, usage
    assert PROGRAMS_PER_SM * (attn["shared"] + 1024) <= SM_SHARED, usage


@pytest.mark.slow
def test_perm_and_kv_prefetches_compile_to_l2_prefetches_within_the_programs_per_sm(monkeypatch):
    """``saap.PREFETCH_LINES``, ``PREFETCH_KV`` and ``saap_select.SELECT_PREFETCH_LINES`` (the interpreter runs
    without them: PTX only) compile to L2 prefetches; the attention stays within the registers and shared memory of
    PROGRAMS_PER_SM programs an SM and the fused scoring launch leaves room for one beside each of its programs,
    neither spilling."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA tests run the kernels on this machine's GPU")
    from attnopt.runtime.strategies.saap import BLOCK_N, PROGRAMS_PER_SM

    job, scoring = _record(monkeypatch, BLOCK_N, fused=True)
    job["consts"].update(PREFETCH_LINES=4, KV_LINES=2, KV_LINE_ELEMS=64, WAIT_PRIOR=True, FUSED=False)  # bf16, chained
    job["options"].pop("maxnreg")
    scoring["consts"].update(PERM_LINES=4)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps([job, scoring], default=str), text=True,
                          capture_output=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    usage = json.loads(proc.stdout.strip().splitlines()[-1])
    attn, rows = usage["_saap_kernel"], usage["_saap_rows_kernel"]
    assert attn["prefetches"] >= 4 + 2 * 2 and attn["stack"] == 0, attn  # perm lines, then K and V lines
    assert rows["prefetches"] >= 4 and rows["stack"] <= 32, rows  # libdevice's trig array only (see above)
    rows_regs = -(-rows["regs"] // 8) * 8 * rows["threads"]
    assert rows_regs + -(-attn["regs"] // 8) * 8 * attn["threads"] <= SM_REGISTERS, usage
    assert PROGRAMS_PER_SM * -(-attn["regs"] // 8) * 8 * attn["threads"] <= SM_REGISTERS, attn
    assert PROGRAMS_PER_SM * (attn["shared"] + 1024) <= SM_SHARED, attn
