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


# Table 1 status. Reproduced within 2x: 32k (0.51x) and 256k (0.54x). NOT reproduced: 64k (0.30x) and 128k
# (0.41x): the paper's per-call difference grows 6.8 -> 11.6 ms from 32k to 64k (+469 MB of transfers, ~100 GB/s
# at the margin) and then 11.6 -> 12.8 ms to 128k (+938 MB), which no single bandwidth explains; the paper's
# standard errors put about +-1.7 ms on each per-call value.
TABLE1_WITHIN_2X = {32_000: True, 64_000: False, 128_000: False, 256_000: True}


@pytest.mark.parametrize("point", P.TABLE1_POINTS, ids=lambda p: f"{p.context // 1000}k")
def test_table1_ring_minus_tree_per_call(point):
    r = P.table1_prediction(HW, point)
    assert 0 < r["predicted_us"] < r["measured_us"]  # the model never over-predicts the ring's extra time
    assert (0.5 <= r["ratio"] <= 2.0) == TABLE1_WITHIN_2X[point.context], r


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
