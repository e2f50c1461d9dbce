"""Manual GPU check (not collected by pytest): rows that an additive mask hides whole with ``finfo.min``, on CUDA.

Eager attention (and SDPA's math backend, and SDPA on the CPU) gives the mean of V over such a row: fp32 absorbs the
scores into the bias, so every key ties. SDPA's memory-efficient CUDA kernel multiplies the biased scores by
log2(e) in fp32, where ``finfo.min * log2(e)`` overflows to -inf: it may give 0 there instead. This prints, for fp32
and bf16 masks:

* what each SDPA backend gives on such a row against the eager softmax;
* what ``attnopt.optimize`` gives for an eager chain (the original is eager) and for an SDPA call (the original is
  whatever SDPA picks), under the dense plan (SDPA again) and split-KV / stream-K (Triton).

Run: ``python tests/passes/gpu_check_finfo_min_rows.py``. A ``DIFF`` line for an eager chain is a silent wrong
answer of the rewrite on this GPU; for an SDPA call it shows which SDPA behaviour the rewrite follows.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnopt

dev = "cuda"
torch.manual_seed(0)
B, H, L, N, D = 1, 4, 1, 300, 64


def eager(q, k, v, m):
    s = (q.float() @ k.float().transpose(-1, -2)) * D ** -0.5 + m.float()
    return (F.softmax(s, -1) @ v.float()).to(q.dtype)


def eager_chain(q, k, v, m):  # what a model writes (HF eager attention)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5 + m
    return F.softmax(s, -1, dtype=torch.float32).to(q.dtype) @ v


def sdpa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def report(name, out, ref, row):
    err = (out.float() - ref.float())[..., row, :].abs().max().item()
    print(f"{'ok  ' if err < 2e-2 else 'DIFF'} {name}: max abs diff on the hidden row {err:.3e} "
          f"(|out| {out[..., row, :].float().abs().max().item():.3e})")


for dtype in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=dtype) for n in (L, N, N))
    m = torch.zeros(B, 1, L, N, device=dev, dtype=dtype)
    m[..., 0, :] = torch.finfo(dtype).min  # the (only) query row: every key at finfo.min
    ref = eager(q, k, v, m)
    print(f"--- {dtype}: eager gives the mean of V: {(ref.float() - v.float().mean(2, keepdim=True)).abs().max():.2e}")
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                report(f"SDPA {backend.name}", sdpa(q, k, v, m), ref, 0)
        except RuntimeError as e:
            print(f"n/a  SDPA {backend.name}: {str(e).splitlines()[0][:100]}")
    report("SDPA default", sdpa(q, k, v, m), ref, 0)
    for plan in ("dense", "split_kv", "stream_k"):
        for name, fn in (("eager chain", eager_chain), ("SDPA call", sdpa)):
            torch._dynamo.reset()
            opt = attnopt.optimize(fn, force_plan=plan, inner_backend="eager")
            out = opt(q, k, v, m)
            rewritten = [s.rewritten for s in attnopt.last_plans(opt).sites]
            report(f"attnopt {plan} on an {name} (rewritten {rewritten})", out, ref, 0)
