"""Collective cost (α-β over a ``Topology``) and the cost of tree and ring decode, in microseconds.

One collective call costs ``α_sw`` (software latency: NCCL launch, proxy and sync, measured on the lent
2xH200: about 20 µs eager, 7 µs inside a CUDA graph) plus, per algorithm step, the hop latency, plus the
bytes over the bottleneck bandwidth. Messages below ``SMALL_MESSAGE_BYTES`` also pay the small-message
protocol's bandwidth (NCCL LL), fitted to the same measurements.

Algorithms (NCCL's, ``p`` ranks, ``M`` bytes per rank):

* ring all-reduce: ``2 (p-1)`` steps, ``2 (p-1)/p M`` bytes per rank;
* tree all-reduce (double binary tree across nodes, a chain inside one): ``2 (g-1) + 2 ceil(log2 n)``
  steps, ``2 M`` bytes; NCCL picks the faster of ring and tree;
* ring all-gather: ``p-1`` steps, ``(p-1) M`` bytes (NCCL's all-gather has no tree);
* hierarchical forms (explicit, two calls or more): inside each node, then across nodes over the
  rail-aligned NICs (each GPU carries ``1/g`` of the data), then inside each node again for an all-reduce;
* a P2P ring step: every rank sends ``M`` bytes to the next at once: ``α_p2p + hop latency + M / bw``.

``tree_decode_us`` and ``ring_decode_us`` add the local attention over the ``1/world`` shard (the kernel
cost model's best single-device plan) and the merges.
"""
from __future__ import annotations

import dataclasses
import math

from attnopt.hardware import HardwareProfile
from attnopt.site import AttentionSite
from attnopt.topology import Topology, resolve_topology

from . import kernel

#: Messages up to this size pay the small-message protocol bandwidth (``Topology.small_msg_gbps``).
SMALL_MESSAGE_BYTES = 256 * 1024
TREE_COLLECTIVES = ("all_gather", "all_reduce", "all_reduce3")
#: Eager ops (each ``hw.launch_us``) of the steps in runtime/distributed/: packing [num | den] into one buffer,
#: packing a state [o | m | log l] (one concatenation: a launch when its parts are fp32, a copy per part when o is
#: in the model's dtype), merging states, rescaling into [num | den], and the final division.
PACK_LAUNCHES = 2
STATE_PACK_LAUNCHES = 2
MERGE_LAUNCHES = 3
RESCALE_LAUNCHES = 4
FINISH_LAUNCHES = 3
RING_VARIANTS = ("pass_kv", "pass_q")
ALL_REDUCE_ALGOS = ("auto", "ring", "tree")


def _alpha(topo: Topology, graph: bool) -> float:
    return topo.graph_collective_us if graph else topo.collective_us


def _small(topo: Topology, nbytes: float, graph: bool) -> float:
    bw = topo.graph_small_msg_gbps if graph else topo.small_msg_gbps
    return min(nbytes, SMALL_MESSAGE_BYTES) / (bw * 1e3)


def _intra_link(topo: Topology, ranks: int) -> tuple[float, float]:
    """(bandwidth GB/s, hop latency µs) of a ring inside one node over ``ranks`` GPUs."""
    if ranks <= 1:
        return math.inf, 0.0
    return topo.ring_bottleneck(ranks)


def _inter_link(topo: Topology) -> tuple[float, float]:
    return topo.inter.gbps, topo.inter.latency_us


# --------------------------------------------------------------------------------------------- collectives
def all_reduce_us(nbytes: float, world: int, topology: Topology | str, algorithm: str = "auto",
                  graph: bool = False) -> float:
    """One NCCL all-reduce of ``nbytes`` per rank over ranks 0..world-1.

    Parameters
    ----------
    nbytes
        Payload per rank, bytes.
    world
        Ranks (filling nodes in order).
    topology
        A ``Topology`` or its name.
    algorithm
        ``ring``, ``tree`` or ``auto`` (the faster, as NCCL's tuner picks).
    graph
        Whether the call is captured in a CUDA graph (lower software latency).
    """
    topo = resolve_topology(topology, world)
    topo.check_world(world)
    if algorithm not in ALL_REDUCE_ALGOS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; valid: {', '.join(ALL_REDUCE_ALGOS)}")
    if world == 1:
        return 0.0
    alpha = _alpha(topo, graph) + _small(topo, nbytes, graph)
    bw, lat = topo.ring_bottleneck(world)
    ring = alpha + 2 * (world - 1) * lat + 2 * (world - 1) / world * nbytes / (bw * 1e3)
    g, n = topo.split(world)
    ibw, ilat = _intra_link(topo, g)
    tree = alpha + 2 * (g - 1) * ilat + 2 * nbytes / (min(ibw, bw) * 1e3)
    if n > 1:
        xbw, xlat = _inter_link(topo)
        tree += 2 * math.ceil(math.log2(n)) * xlat
    if algorithm == "ring":
        return ring
    if algorithm == "tree":
        return tree
    return min(ring, tree)


def all_gather_us(nbytes: float, world: int, topology: Topology | str, graph: bool = False) -> float:
    """One NCCL ring all-gather of ``nbytes`` per rank (each rank receives ``(world-1) * nbytes``)."""
    topo = resolve_topology(topology, world)
    topo.check_world(world)
    if world == 1:
        return 0.0
    bw, lat = topo.ring_bottleneck(world)
    return (_alpha(topo, graph) + _small(topo, nbytes * world, graph) + (world - 1) * lat
            + (world - 1) * nbytes / (bw * 1e3))


def _rail_group_us(op: str, nbytes: float, nodes: int, topo: Topology, graph: bool) -> float:
    """A collective among one GPU per node (a rail), ``nodes`` ranks over the inter-node link."""
    if nodes <= 1:
        return 0.0
    xbw, xlat = _inter_link(topo)
    alpha = _alpha(topo, graph) + _small(topo, nbytes * (nodes if op == "all_gather" else 1), graph)
    if op == "all_gather":
        return alpha + (nodes - 1) * xlat + (nodes - 1) * nbytes / (xbw * 1e3)
    ring = 2 * (nodes - 1) * (xlat + nbytes / nodes / (xbw * 1e3))
    tree = 2 * math.ceil(math.log2(nodes)) * xlat + 2 * nbytes / (xbw * 1e3)
    return alpha + min(ring, tree)


def hierarchical_all_reduce_us(nbytes: float, world: int, topology: Topology | str, graph: bool = False) -> float:
    """Explicit two-level all-reduce: reduce-scatter inside each node, all-reduce of the ``1/g`` slices across
    nodes (every GPU on its own rail), all-gather inside each node: three calls. One node: a plain all-reduce."""
    topo = resolve_topology(topology, world)
    g, n = topo.split(world)
    if n == 1:
        return all_reduce_us(nbytes, world, topo, graph=graph)
    ibw, ilat = _intra_link(topo, g)
    alpha = _alpha(topo, graph)
    intra_half = alpha + _small(topo, nbytes, graph) + (g - 1) * ilat + (g - 1) / g * nbytes / (ibw * 1e3)
    return 2 * intra_half + _rail_group_us("all_reduce", nbytes / g, n, topo, graph)


def hierarchical_all_gather_us(nbytes: float, world: int, topology: Topology | str, graph: bool = False,
                               combine_us: float = 0.0, combined_bytes: float | None = None) -> float:
    """Explicit two-level all-gather: inside each node, then across nodes among rail peers.

    With ``combined_bytes`` (tree decode), each node first merges what it gathered into ``combined_bytes``
    (taking ``combine_us``), so the inter-node stage moves one merged state per node instead of ``g``.
    """
    topo = resolve_topology(topology, world)
    g, n = topo.split(world)
    if n == 1:
        return all_gather_us(nbytes, world, topo, graph=graph)
    intra = all_gather_us(nbytes, g, topo, graph=graph)
    across = combined_bytes if combined_bytes is not None else nbytes * g
    return intra + combine_us + _rail_group_us("all_gather", across, n, topo, graph)


def p2p_step_us(nbytes: float, world: int, topology: Topology | str, graph: bool = False) -> float:
    """One ring step: every rank sends ``nbytes`` to the next rank at once (batch_isend_irecv). Inside a CUDA
    graph the host-side software latency of the step is gone, as for the collectives."""
    topo = resolve_topology(topology, world)
    topo.check_world(world)
    if world == 1:
        return 0.0
    bw, lat = topo.ring_bottleneck(world)
    if topo.p2p_gbps > 0:  # what NCCL send/recv reaches on this fabric, measured; never above the slowest hop
        bw = min(bw, topo.p2p_gbps)
    software = topo.p2p_us * (topo.graph_collective_us / topo.collective_us if graph and topo.collective_us else 1.0)
    return software + lat + topo.p2p_step_us + nbytes / (bw * 1e3)


# --------------------------------------------------------------------------------------------- decode
def shard_site(site: AttentionSite, world: int) -> AttentionSite:
    """The site each rank sees: ``ceil(N / world)`` keys of the sequence-sharded cache."""
    n = kernel._kv_len(site)
    return dataclasses.replace(site, kv_len=max(1, math.ceil(n / world)), kv_len_hint=None)


_LOCAL_CACHE: dict[tuple, float] = {}


def local_attention_us(site: AttentionSite, hw: HardwareProfile, world: int) -> float:
    """Local attention over the ``1/world`` shard with the best single-device plan, returning (o, lse).

    Memoised per (shard, profile): the tree and ring variants of one site share it.
    """
    shard = shard_site(site, world)
    key = (shard, hw.to_json())
    us = _LOCAL_CACHE.get(key)
    if us is None:
        if len(_LOCAL_CACHE) > 4096:
            _LOCAL_CACHE.clear()
        us = _LOCAL_CACHE[key] = kernel.best_single_device_us(shard, hw)[1]
    return us


def _merge_us(hw: HardwareProfile, nbytes: float, launches: int = 1) -> float:
    return launches * hw.launch_us + nbytes / (hw.hbm_read_gbps * 1e3 * hw.kernel_efficiency)


def tree_decode_us(site: AttentionSite, hw: HardwareProfile, topology: Topology | str, world: int,
                   collective: str = "all_gather", hierarchical: bool = False, graph: bool = False) -> float:
    """Tree decode over ``world`` ranks: local attention on the shard, then the reduction of softmax states.

    Parameters
    ----------
    collective
        ``all_gather``: one all-gather of packed (o, m, log l), then a local merge of the ``world`` states;
        ``all_reduce``: an all-reduce (max) of the row max, then one all-reduce (sum) of [num | den];
        ``all_reduce3``: the paper's three all-reduces (max, numerator, denominator).
    hierarchical
        Explicit two-level collectives (inside a node, then across nodes); equal to the flat form on one node.
    graph
        Whether the step is captured in a CUDA graph.
    """
    topo = resolve_topology(topology, world)
    topo.check_world(world)
    if collective not in TREE_COLLECTIVES:
        raise ValueError(f"unknown tree collective {collective!r}; valid: {', '.join(TREE_COLLECTIVES)}")
    local = local_attention_us(site, hw, world)
    if world == 1:
        return local
    state = kernel.state_bytes(site)                 # (o, lse) fp32: [num | den]
    packed = kernel.packed_state_bytes(site)         # [o | m | log l] fp32: what the all-gather moves
    b, hkv, g, L, d, dv, e = kernel._dims(site)
    lse = float(b * hkv * g * L * 4)
    out = float(b * hkv * g * L * dv * site.dtype_bytes)
    # Launch counts follow runtime/distributed.py: packing (o, lse), the merge, the rescale into [num | den]
    # and the final division are a few eager ops each (``hw.launch_us`` apiece).
    if collective == "all_gather":
        if hierarchical:
            gpn, _ = topo.split(world)
            merge_node = _merge_us(hw, packed * gpn, launches=MERGE_LAUNCHES)
            comm = hierarchical_all_gather_us(packed, world, topo, graph=graph, combine_us=merge_node,
                                              combined_bytes=packed)
            n = topo.num_nodes(world)
            return (local + _merge_us(hw, packed, STATE_PACK_LAUNCHES) + comm
                    + _merge_us(hw, packed * n + out, MERGE_LAUNCHES))
        return (local + _merge_us(hw, packed, STATE_PACK_LAUNCHES) + all_gather_us(packed, world, topo, graph=graph)
                + _merge_us(hw, packed * world + out, MERGE_LAUNCHES))
    ar = hierarchical_all_reduce_us if hierarchical else all_reduce_us
    if collective == "all_reduce":
        # max of lse; rescale into [num | den] (a few ops); sum; divide.
        return (local + _merge_us(hw, lse, 1) + ar(lse, world, topo, graph=graph)
                + _merge_us(hw, 2 * state, RESCALE_LAUNCHES + PACK_LAUNCHES)
                + ar(state, world, topo, graph=graph) + _merge_us(hw, state + out, FINISH_LAUNCHES))
    # all_reduce3: max, then numerator and denominator in two separate all-reduces.
    return (local + _merge_us(hw, lse, 1) + ar(lse, world, topo, graph=graph) + _merge_us(hw, 2 * state, RESCALE_LAUNCHES)
            + ar(state - lse, world, topo, graph=graph) + ar(lse, world, topo, graph=graph)
            + _merge_us(hw, state + out, FINISH_LAUNCHES))


def ring_decode_us(site: AttentionSite, hw: HardwareProfile, topology: Topology | str, world: int,
                   variant: str = "pass_kv", graph: bool = False) -> float:
    """Ring decode over ``world`` ranks.

    Parameters
    ----------
    variant
        ``pass_kv`` (Ring Attention's baseline): ``world - 1`` steps, each sending the current K/V shard to the
        next rank while attending to it (overlapped: a step costs the slower of the two) and merging.
        ``pass_q``: every rank attends to its own shard, then ``world - 1`` steps pass the running (o, m, log l) to
        the next rank, which merges its own state in (at decode the query is already on every rank).
    graph
        Whether the step is captured in a CUDA graph.
    """
    topo = resolve_topology(topology, world)
    topo.check_world(world)
    if variant not in RING_VARIANTS:
        raise ValueError(f"unknown ring variant {variant!r}; valid: {', '.join(RING_VARIANTS)}")
    local = local_attention_us(site, hw, world)
    if world == 1:
        return local
    state = kernel.packed_state_bytes(site)  # the running (o, m, log l), fp32
    b, hkv, g, L, d, dv, e = kernel._dims(site)
    out = float(b * hkv * g * L * dv * e)
    merge = _merge_us(hw, 3 * state, MERGE_LAUNCHES)
    if variant == "pass_kv":
        shard_kv = kernel.kv_bytes(shard_site(site, world))
        step = max(local, p2p_step_us(shard_kv, world, topo, graph))
        return local + (world - 1) * (step + merge) + _merge_us(hw, state + out)
    # pass_q: the query is replicated at decode, so only the packed state travels; each hop merges and repacks.
    hop = p2p_step_us(state, world, topo, graph) + merge + _merge_us(hw, state, STATE_PACK_LAUNCHES)
    return (local + _merge_us(hw, state, STATE_PACK_LAUNCHES) + (world - 1) * hop
            + _merge_us(hw, state + out, PACK_LAUNCHES))


def best_tree(site: AttentionSite, hw: HardwareProfile, topology: Topology | str, world: int,
              graph: bool = False) -> tuple[str, bool, float]:
    """(collective, hierarchical, µs) of the fastest tree variant."""
    topo = resolve_topology(topology, world)
    hier = (False, True) if topo.num_nodes(world) > 1 else (False,)
    options = [(c, h, tree_decode_us(site, hw, topo, world, c, h, graph=graph)) for c in TREE_COLLECTIVES for h in hier]
    return min(options, key=lambda o: o[2])


def best_ring(site: AttentionSite, hw: HardwareProfile, topology: Topology | str, world: int,
              graph: bool = False) -> tuple[str, float]:
    """(variant, µs) of the fastest ring variant."""
    topo = resolve_topology(topology, world)
    options = [(v, ring_decode_us(site, hw, topo, world, v, graph)) for v in RING_VARIANTS]
    return min(options, key=lambda o: o[1])


# --------------------------------------------------------------------------------------------- simulation
def simulate_tree_vs_ring(site: AttentionSite, hw: HardwareProfile, topology: Topology | str,
                          gpu_counts: "list[int] | tuple[int, ...]", contexts: "list[int] | tuple[int, ...]",
                          graph: bool = False) -> list[dict]:
    """Tree against ring for every (GPU count, context length): one row each.

    Row fields: ``gpus``, ``nodes``, ``N``, ``tree_us`` and ``tree_variant`` (the fastest tree collective and
    whether hierarchical), ``ring_pass_kv_us`` (Ring Attention's baseline, the paper's), ``ring_pass_q_us``,
    ``best_ring`` and ``best_ring_us``, ``speedup_vs_pass_kv`` and ``speedup_vs_best_ring`` (ring / tree), and
    ``local_us`` (the shard's attention alone).
    """
    topo = resolve_topology(topology, max(gpu_counts))
    rows = []
    for p in gpu_counts:
        topo.check_world(p)
        for n in contexts:
            s = dataclasses.replace(site, kv_len=int(n), kv_len_hint=None)
            coll, hier, tree = best_tree(s, hw, topo, p, graph=graph)
            kv = ring_decode_us(s, hw, topo, p, "pass_kv")
            pq = ring_decode_us(s, hw, topo, p, "pass_q")
            best_ring_name, best_ring_us = ("pass_kv", kv) if kv <= pq else ("pass_q", pq)
            rows.append({"gpus": p, "nodes": topo.num_nodes(p), "N": int(n), "tree_us": tree,
                         "tree_variant": f"{coll}{'+hierarchical' if hier else ''}", "ring_pass_kv_us": kv,
                         "ring_pass_q_us": pq, "best_ring": best_ring_name, "best_ring_us": best_ring_us,
                         "speedup_vs_pass_kv": kv / tree, "speedup_vs_best_ring": best_ring_us / tree,
                         "local_us": local_attention_us(s, hw, p)})
    return rows


def crossovers(rows: list[dict], key: str = "speedup_vs_best_ring") -> dict[int, float | None]:
    """Per GPU count, the context length where ``key`` crosses 1 (tree starts to win, or stops winning),
    interpolated in log space between the simulated lengths; ``None`` when it never crosses."""
    out: dict[int, float | None] = {}
    for p in sorted({r["gpus"] for r in rows}):
        pts = sorted(((r["N"], r[key]) for r in rows if r["gpus"] == p))
        out[p] = None
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if (s0 - 1) * (s1 - 1) < 0:
                t = (math.log(s0)) / (math.log(s0) - math.log(s1))
                out[p] = float(math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0))))
                break
    return out
