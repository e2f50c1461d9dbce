"""The SAAP query MLP's scoring alone (``saap_select(launches="scoring")``: the hidden-layer launch and the logits
launch), timed in CUDA graphs on a llama3-8b layer (8 KV heads, 32 query heads, D = 128, hidden 1024, 2048
clusters), at several tilings of the logits launch, against its HBM floor: the weights as the rule reads them
(``saap_rule.scoring_mlp``: bf16, BatchNorm folded), 8 layers' weights in turn so that they miss in L2.

Rows: ``o<BLOCK_LOGITS_H>-k<BLOCK_K_HIDDEN>-s<MLP_LOGITS_STAGES>`` (the module's constants, set for the row); ``us``
the median per call, ``floor_us`` the weights' bytes over the measured read bandwidth; ``-pdl`` rows chained by
programmatic dependent launch (``PDL``). Run on a GPU:
``python benchmarks/saap_mlp_scoring.py [--out FILE]`` (about 30 s on an H100).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

#: (BLOCK_LOGITS_H, BLOCK_K_HIDDEN, MLP_LOGITS_STAGES, BLOCK_HIDDEN, w2 in float8) per row; the second is the
#: module's default since these rows measured it fastest. The float8 rows (suffix ``-f8``, w2 cast to float8_e4m3fn unscaled: no rule computes it, its logits are
#: not the reference's) time what half the logits launch's bytes would give.
VARIANTS = ((32, 128, 3, 64, False), (64, 128, 3, 64, False), (32, 128, 3, 32, False), (32, 128, 3, 64, True))
#: Each row also chained by programmatic dependent launch (suffix ``-pdl``: the logits launch asks L2 for its w2 rows
#: before it waits for the hidden launch, ``saap_select.MLP_PREFETCH_W2``), and so without the prefetch
#: (``-pdl-noprefetch``), where the GPU and Triton have it.
PDL = ((False, True), (True, True), (True, False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)

    from attnopt.bench.common import cycle, read_bandwidth_TBps, results_header, time_us
    from attnopt.runtime.kernels import saap_select as sel
    from attnopt.runtime.kernels.common import pdl_supported
    from attnopt.runtime.kernels.saap_rule import ScoringMLP, mlp_logits
    from attnopt.runtime.saap.rope import RopeSpec, remove_rope

    Hq, Hkv, D, H, C, N = 32, 8, 128, 1024, 2048, 131072
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [ScoringMLP((torch.randn(Hkv, H, D, device="cuda", generator=gen) / math.sqrt(D)).bfloat16(),
                         torch.randn(Hkv, H, device="cuda", generator=gen) * 0.1,
                         (torch.randn(Hkv, C, H, device="cuda", generator=gen) / math.sqrt(H)).bfloat16(),
                         torch.zeros(Hkv, C, device="cuda")) for _ in range(args.layers)]
    rope = RopeSpec(500000.0, D)
    inv_freq = rope.inv_freq("cuda").contiguous()
    q = torch.randn(1, Hq, 1, D, device="cuda", generator=gen).bfloat16()
    offsets = torch.zeros(1, Hkv, C + 1, dtype=torch.int32, device="cuda")
    ends = torch.full((1,), N - 2048, dtype=torch.int32, device="cuda")
    reads = read_bandwidth_TBps()["best"]
    results = results_header("saap-mlp-scoring", read_bw_TBps=round(reads, 4),
                             timing="us: median per call over CUDA-graph replays, weights of 8 layers in turn")
    want = mlp_logits(layers[0], remove_rope(q, torch.tensor([N - 1], device="cuda"), rope).reshape(1, Hkv, 4, D))
    defaults = (sel.BLOCK_LOGITS_H, sel.BLOCK_K_HIDDEN, sel.MLP_LOGITS_STAGES, sel.BLOCK_HIDDEN, sel.MLP_PREFETCH_W2)
    try:
        for (bo, bk, st, bh, f8), (pdl, ahead) in [(v, c) for v in VARIANTS for c in PDL
                                                   if not c[0] or pdl_supported(torch.device("cuda"))]:
            sel.BLOCK_LOGITS_H, sel.BLOCK_K_HIDDEN, sel.MLP_LOGITS_STAGES, sel.BLOCK_HIDDEN = bo, bk, st, bh
            sel.MLP_PREFETCH_W2 = ahead
            name = f"o{bo}-k{bk}-s{st}" + (f"-h{bh}" if bh != 64 else "") + ("-f8" if f8 else "") + (
                ("-pdl" if ahead else "-pdl-noprefetch") if pdl else "")
            row = {"method": name, "block_logits_h": bo, "block_k_hidden": bk, "stages": st, "block_hidden": bh,
                   "w2_float8": f8, "pdl": pdl, "prefetch_w2": pdl and ahead}
            try:
                ws = [sel.select_workspace(1, Hkv, 4, C, H, "cuda") for _ in layers]
                mlps = [m._replace(w2=m.w2.to(torch.float8_e4m3fn)) if f8 else m for m in layers]
                scorers = [sel.SaapScorer(torch.zeros(Hkv, C, D, device="cuda"), inv_freq, m) for m in mlps]
                nbytes = sum(t.numel() * t.element_size() for t in mlps[0])

                def call(i):
                    return lambda: sel.saap_select(q, offsets, ends, ws[i], probes=64, scale=D ** -0.5, n_keys=N,
                                                   scorer=scorers[i], launches="scoring", pdl=pdl)
                calls = [call(i) for i in range(len(layers))]
                calls[0]()
                torch.cuda.synchronize()
                row["max_abs_err"] = float((ws[0].logits - want).abs().max())
                row["us"] = time_us(cycle(calls), "graph")
                row["weight_bytes"] = nbytes
                row["floor_us"] = nbytes / (reads * 1e12) * 1e6
                row["frac_of_floor"] = row["floor_us"] / row["us"]
            except Exception as exc:  # noqa: BLE001 - one failing tiling must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results.setdefault("rows", []).append(row)
            print(json.dumps(row), flush=True)
    finally:
        (sel.BLOCK_LOGITS_H, sel.BLOCK_K_HIDDEN, sel.MLP_LOGITS_STAGES, sel.BLOCK_HIDDEN,
         sel.MLP_PREFETCH_W2) = defaults
    out = args.out or "benchmarks/results/saap-mlp-scoring.json"
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
