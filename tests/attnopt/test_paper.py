"""The multi-GPU model against the Tree Attention paper's measured points (attnopt.cost.paper), and the explain
output and plot that show them labelled as measured or predicted.

Paper numbers (arXiv:2408.04093, /work/shared/papers/tree_attention.txt):
* Sec. 6.1, text under the latency figure: "Tree Attention achieves close x8 speedups when we use 128 GPUs on a
  sequence length of 5.12M" (16 heads of dim 128; 16 DGX H100 nodes of 8 GPUs).
* Table 1 (Sec. 6.4), 8x H100 columns, seconds to decode 10 tokens with prefill, Llama 3.1-8B:
  32k 0.60 / 2.57, 64k 1.08 / 4.42, 128k 2.68 / 6.38, 256k 2.89 / 8.19 (tree / ring).
"""
import math

import pytest

from attnopt.cli import main
from attnopt.cost import paper as P
from attnopt.hardware import builtin_profile

HW = builtin_profile("h100-sxm")


def test_the_encoded_points_are_the_papers_numbers():
    assert (P.SEC61_POINT.gpus, P.SEC61_POINT.context, P.SEC61_POINT.measured) == (128, 5_120_000, 8.0)
    # Table 1: (ring - tree) seconds over 9 decode steps x 32 layers, per call in µs.
    expected = {32_000: (2.57 - 0.60), 64_000: (4.42 - 1.08), 128_000: (6.38 - 2.68), 256_000: (8.19 - 2.89)}
    for p in P.TABLE1_POINTS:
        assert p.measured == pytest.approx(expected[p.context] / 288 * 1e6)


def test_device_time_alone_cannot_give_the_papers_8x():
    """Ring Attention runs p steps, each at least one shard transfer over the slowest hop; the tree is one local
    attention and three small all-reduces: at p = 128 the device-time ratio is in the thousands."""
    s = P.sec61_prediction(HW)
    assert s["device_ratio"] > 100
    site = P._site(P.SEC61_POINT)
    chunk_bytes = P.K.kv_bytes(P.C.shard_site(site, 128))
    assert s["ring_us"] >= 128 * chunk_bytes / (45.0 * 1e3)  # 128 transfers over a 45 GB/s IB hop


def test_sec61_point_within_2x_with_the_harness_first_call():
    """The paper's scripts (tree_shard_test.py, ring_shard_test.py) time one call of a freshly jitted function:
    with a first-call overhead C on both timings the model reproduces ~8x within 2x for C in a range that an XLA
    compilation of such a program takes (tenths of a second)."""
    from attnopt.commands.explain import PAPER_FIRST_CALL_S

    s = P.sec61_prediction(HW, PAPER_FIRST_CALL_S)
    assert 8.0 / 2 <= s["ratio_with_harness"] <= 8.0 * 2
    low, high = s["harness_s_for_2x"]
    assert 0.03 <= low <= PAPER_FIRST_CALL_S <= high <= 1.0


def test_harness_range_arithmetic():
    low, high = P.harness_range_s(ring_us=1e6, tree_us=1e3, measured=8.0)
    assert (1.0 + low) / (1e-3 + low) == pytest.approx(16.0)
    assert (1.0 + high) / (1e-3 + high) == pytest.approx(4.0)
    assert all(math.isnan(x) for x in P.harness_range_s(ring_us=2.0, tree_us=1.0, measured=8.0))


@pytest.mark.parametrize("point", P.TABLE1_POINTS, ids=lambda p: f"{p.context // 1000}k")
def test_table1_ring_minus_tree_per_call_within_2x(point):
    """Every Table 1 point within 2x (0.65x, 0.52x, 0.73x, 0.86x at 32k-256k with the h100-sxm profile), from two
    corrections that read no paper number: the ring's local copies (``ring_copies_us``) and NCCL send/recv steps as
    this project measured them (``test_p2p_steps_match_this_projects_measured_rings``). Before them 64k and 128k
    were at 0.30x and 0.41x. The model still under-predicts the ring's extra time everywhere."""
    r = P.table1_prediction(HW, point)
    assert 0 < r["predicted_us"] < r["measured_us"]
    assert 0.5 <= r["ratio"] <= 2.0, r


def test_ring_copies_are_eight_passes_over_the_local_kv():
    """contiguous (read + write), cat to float32 (read 1x, write 2x), back to bf16 (read 2x, write 1x)."""
    chunk = P.C.shard_site(P._site(P.TABLE1_POINTS[1]), 8)
    kv = P.K.kv_bytes(chunk)
    assert kv == 8000 * 32 * 128 * 2 * 2  # 64k / 8 ranks, K and V expanded to 32 heads, bf16
    assert P.ring_copies_us(chunk, HW) == pytest.approx(8 * kv / (HW.copy_gbps * 1e3) + 6 * HW.launch_us)


def test_p2p_steps_match_this_projects_measured_rings():
    """The P2P step model (``topology.NVLINK4_P2P_*``) against every pass-KV ring step this project timed in CUDA
    graphs on 2x and 4x H200 (NVLink 4): within 0.65-1.4x of each (the link's 390 GB/s alone gave 0.39-0.8x)."""
    import json
    import os

    from attnopt.topology import builtin_topology

    root = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
    ratios = []
    for name in ("multigpu-2xh200-stepgraph-0c072be.json", "multigpu-4xh200-2026-11-22.json"):
        with open(os.path.join(root, name)) as f:
            data = json.load(f)
        world = data["world_size"]
        topo = builtin_topology(f"{world}x-h200-nvlink")
        for r in data["rows"]:
            if r.get("method") == "ring:pass_kv" and r["mode"] == "graph":
                step_bytes = r["B"] * r["Hkv"] * r["N_local"] * 2 * r["D"] * 2
                ratios.append(P.C.p2p_step_us(step_bytes, world, topo, graph=True) / (r["us"] / (world - 1)))
    assert len(ratios) == 12 and 0.65 <= min(ratios) and max(ratios) <= 1.4, ratios


def test_explain_labels_measured_and_predicted(capsys, tmp_path):
    png = tmp_path / "paper.png"
    rc = main(["explain", "--heads", "16", "--head-dim", "128", "--context", "5120000", "--gpus", "128",
               "--topology", "dgx-h100x16", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert "measured ~8x; predicted" in out and "first-call overhead" in out
    assert out.count("per decode call measured") == 4


def test_sec61_trends_with_the_harness_first_call():
    """Sec. 6.1's qualitative claims, under the same first-call overhead: relative to the ring at 80k, the tree's
    time stays flat while the ring's keeps growing with the context; the gap widens with the context and with the
    GPU count (8 GPUs = 1 node, 64 = 8 nodes, 128 = 16 nodes)."""
    from attnopt.commands.explain import PAPER_FIRST_CALL_S

    contexts = (80_000, 320_000, 1_280_000, 5_120_000)
    curves = {p: P.sec61_curve(HW, p, contexts, PAPER_FIRST_CALL_S) for p in (8, 64, 128)}
    rows = curves[128]
    assert max(r["tree_rel"] for r in rows) / min(r["tree_rel"] for r in rows) < 1.2
    assert rows[-1]["ring_rel"] > 3 * rows[0]["ring_rel"]
    assert [r["speedup"] for r in rows] == sorted(r["speedup"] for r in rows)
    at_end = [curves[p][-1]["speedup"] for p in (8, 64, 128)]
    assert at_end == sorted(at_end) and at_end[-1] == pytest.approx(P.sec61_prediction(HW, PAPER_FIRST_CALL_S)["ratio_with_harness"])
