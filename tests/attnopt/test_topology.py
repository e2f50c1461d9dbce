"""Topologies (built-ins, graph, JSON, detection, errors) and the tree-vs-ring simulation's trend."""
import math

import pytest

from attnopt.cost import collective as C
from attnopt.hardware import builtin_profile
from attnopt.site import AttentionSite
from attnopt.topology import (BUILTIN_TOPOLOGIES, Link, Topology, builtin_topology, detect_topology,
                              parse_nvidia_smi_topo, resolve_topology, topology_from_local)

REQUIRED = ("dgx-h100x1", "dgx-h100x2", "dgx-h100x16", "2x4090-pcie", "8x-mi300x", "2x-h200-nvlink")


@pytest.mark.parametrize("name", sorted(BUILTIN_TOPOLOGIES))
def test_builtins_round_trip(name):
    topo = BUILTIN_TOPOLOGIES[name]
    assert Topology.from_json(topo.to_json()) == topo
    g = topo.graph()
    gpus = [n for n in g.nodes if n[0] == "gpu"]
    assert len(gpus) == topo.world_size
    assert all("bandwidth" in d and "latency" in d for _, _, d in g.edges(data=True))
    builtin_profile(topo.device)  # every topology names a known hardware profile


def test_required_builtins_and_sizes():
    assert set(REQUIRED) <= set(BUILTIN_TOPOLOGIES)
    dgx = builtin_topology("dgx-h100x16")
    assert dgx.world_size == 128 and dgx.num_nodes(128) == 16 and dgx.num_nodes(9) == 2 and dgx.num_nodes(8) == 1
    assert dgx.split(64) == (8, 8) and dgx.split(4) == (4, 1)
    assert dgx.nodes_for(17) == 3
    assert builtin_topology("dgx-h100x2").world_size == 16


def test_bottlenecks_follow_the_links():
    dgx = builtin_topology("dgx-h100x16")
    intra_bw, intra_lat = dgx.ring_bottleneck(8)
    inter_bw, inter_lat = dgx.ring_bottleneck(16)
    assert intra_bw == pytest.approx(390.0) and inter_bw == pytest.approx(45.0) and inter_lat > intra_lat
    bw, lat = dgx.path(0, 8)                   # same rail, two nodes
    assert bw == pytest.approx(45.0) and lat == pytest.approx(4.0)
    assert dgx.path(3, 3) == (math.inf, 0.0)
    pcie = builtin_topology("2x4090-pcie")
    assert pcie.ring_bottleneck(2)[0] <= 20.0
    assert builtin_topology("8x-mi300x").path(0, 7)[0] == pytest.approx(50.0)


def test_errors_name_the_choices():
    with pytest.raises(ValueError) as err:
        resolve_topology("dgx-b200x4")
    for name in REQUIRED:
        assert name in str(err.value)
    with pytest.raises(ValueError, match=r"world size 256 is larger than topology 'dgx-h100x16' .*128 devices"):
        builtin_topology("dgx-h100x16").check_world(256)
    with pytest.raises(ValueError, match="unknown link kind"):
        Link("smoke-signals", 1.0, 1.0)
    with pytest.raises(ValueError, match="no inter-node link"):
        Topology("x", nodes=2, gpus_per_node=1, device="h100-sxm", intra=Link("nvlink", 1.0, 1.0))
    with pytest.raises(ValueError, match="unknown topology field"):
        Topology.from_dict({**builtin_topology("dgx-h100x1").to_dict(), "color": "green"})


SMI = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tSYS\t0-63\t0\t\tN/A
GPU1\tNV18\t X \tSYS\t0-63\t0\t\tN/A
NIC0\tSYS\tSYS\t X
"""
SMI_PCIE = """\
        GPU0    GPU1    CPU Affinity
GPU0     X      PHB     0-31
GPU1    PHB      X      0-31
"""


def test_nvidia_smi_parsing_and_local_topologies():
    assert parse_nvidia_smi_topo(SMI) == (2, "nvlink", 18)
    assert parse_nvidia_smi_topo(SMI_PCIE) == (2, "pcie", 0)
    with pytest.raises(ValueError):
        parse_nvidia_smi_topo("no gpus here")
    nv = topology_from_local(2, "nvlink", 18, "h200")
    assert nv.world_size == 2 and nv.intra.kind == "nvlink" and nv.intra.gbps <= 390.0
    assert topology_from_local(4, "pcie", 0, "rtx-4090").fabric == "host"


def test_detect_without_gpu_is_one_device():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    topo = detect_topology()
    assert topo.world_size == 1
    wide = resolve_topology(None, 4)
    assert wide.world_size == 4 and "widened" in wide.source
    with pytest.raises(ValueError, match="larger than topology"):
        resolve_topology("2x-h200-nvlink", 4).check_world(4)


def test_topology_json_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(builtin_topology("8x-mi300x").to_json())
    assert resolve_topology(str(p)) == builtin_topology("8x-mi300x")
    p.write_text("{")
    with pytest.raises(ValueError, match="not a valid attnopt topology"):
        resolve_topology(str(p))


# --------------------------------------------------------------------------------------------- simulation
PAPER_SITE = AttentionSite.canonical(q_heads=16, kv_heads=16, head_dim=128, kv_len=5_120_000, gqa_source="mha")
CONTEXTS = (80_000, 320_000, 1_280_000, 5_120_000)
COUNTS = (8, 32, 64, 128)


@pytest.fixture(scope="module")
def sim_rows():
    return C.simulate_tree_vs_ring(PAPER_SITE, builtin_profile("h100-sxm"), "dgx-h100x16", COUNTS, CONTEXTS)


def _speedup(rows, p, n, key="speedup_vs_pass_kv"):
    return next(r[key] for r in rows if r["gpus"] == p and r["N"] == n)


def test_tree_advantage_over_ring_grows_with_context(sim_rows):
    for p in COUNTS:
        s = [_speedup(sim_rows, p, n) for n in CONTEXTS]
        assert s == sorted(s) and s[-1] > s[0], (p, s)


def test_tree_advantage_over_ring_grows_with_gpu_count_at_long_context(sim_rows):
    # At 5.12M tokens (the paper's point) the shard is still long enough that more GPUs shorten the tree step;
    # at shorter contexts the growing collective latency of more nodes can flatten the curve.
    s = [_speedup(sim_rows, p, 5_120_000) for p in COUNTS]
    assert s == sorted(s), s
    best = [_speedup(sim_rows, p, 5_120_000, "speedup_vs_best_ring") for p in COUNTS]
    assert best == sorted(best)


def test_tree_wins_at_the_papers_point(sim_rows):
    row = next(r for r in sim_rows if r["gpus"] == 128 and r["N"] == 5_120_000)
    assert row["nodes"] == 16
    # Tree beats both ring variants clearly; the model's margin over pass-KV is far larger than the paper's
    # measured ~8x (see the issue-5 note), over pass-Q it is of that order.
    assert row["speedup_vs_best_ring"] > 4.0
    assert row["speedup_vs_pass_kv"] > row["speedup_vs_best_ring"]
    assert "hierarchical" in row["tree_variant"]


def test_crossovers_interpolate_in_log_space():
    rows = [{"gpus": 2, "N": 1000, "s": 0.5}, {"gpus": 2, "N": 4000, "s": 2.0}, {"gpus": 4, "N": 1000, "s": 3.0},
            {"gpus": 4, "N": 4000, "s": 5.0}]
    out = C.crossovers(rows, "s")
    assert out[2] == pytest.approx(2000.0) and out[4] is None
