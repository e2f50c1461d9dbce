"""Topologies: devices and links as a networkx graph, with bandwidth (GB/s per direction) and latency (µs).

A ``Topology`` is a frozen, JSON-round-tripping description of a cluster shape: ``nodes`` hosts with
``gpus_per_node`` accelerators each, one link type inside a node (NVLink through NVSwitch, an xGMI mesh, or
PCIe through the host) and one across nodes (InfiniBand, one NIC per GPU, rail-aligned). ``graph()`` builds
the networkx graph the collective cost model walks; the α (software latency per collective call) values
come from measurements (ENVIRONMENT.md, 2xH200 NVLink: eager NCCL all_reduce about 22 µs, all_gather about
22 µs, inside a CUDA graph about 8 µs).

Ranks are placed in order: rank ``r`` is GPU ``r % gpus_per_node`` of node ``r // gpus_per_node``, so a
world smaller than the topology fills whole nodes first.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

TOPOLOGY_VERSION = 1
LINK_KINDS = ("nvlink", "xgmi", "pcie", "ib", "ethernet", "none")
FABRICS = ("switch", "mesh", "host")


@dataclass(frozen=True)
class Link:
    """One link type: ``gbps`` is the achievable bandwidth per direction per device (GB/s), ``latency_us`` the
    one-hop latency."""

    kind: str
    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"unknown link kind {self.kind!r}; valid: {', '.join(LINK_KINDS)}")
        if self.kind != "none" and not (self.gbps > 0 and self.latency_us >= 0):
            raise ValueError(f"link {self.kind}: gbps must be > 0 and latency_us >= 0, got {self.gbps}, {self.latency_us}")


NO_LINK = Link("none", 0.0, 0.0)


@dataclass(frozen=True)
class Topology:
    """A cluster shape for multi-GPU planning.

    Every field round-trips through JSON (``to_json`` / ``from_json``).
    """

    name: str
    #: Hosts.
    nodes: int
    #: Accelerators per host.
    gpus_per_node: int
    #: Hardware profile name of the accelerators (``attnopt.hardware``).
    device: str
    #: The link inside a node.
    intra: Link
    #: How the intra-node link connects devices: ``switch`` (NVSwitch: every GPU its full bandwidth to any
    #: other), ``mesh`` (a direct link per pair), ``host`` (through the CPU: one shared path).
    fabric: str = "switch"
    #: The link across nodes (per GPU, rail-aligned); ``none`` for one node.
    inter: Link = NO_LINK
    #: Software latency of one eager collective call (NCCL launch, proxy, sync), µs.
    collective_us: float = 20.5
    #: The same inside a captured CUDA graph, µs.
    graph_collective_us: float = 7.5
    #: Bandwidth of the small-message protocol (NCCL LL) for the first ``SMALL_MESSAGE_BYTES``, eager, GB/s.
    small_msg_gbps: float = 11.0
    #: The same inside a CUDA graph, GB/s.
    graph_small_msg_gbps: float = 57.0
    #: Software latency of one eager P2P send/recv step (batch_isend_irecv), µs.
    p2p_us: float = 20.0
    #: Bandwidth that NCCL send/recv reaches per rank in a ring step with every rank sending at once, GB/s;
    #: 0 = the slowest hop's link bandwidth.
    p2p_gbps: float = 0.0
    #: Device time of one ring step beyond its bytes / ``p2p_gbps`` (NCCL's P2P protocol ramp and the step's
    #: synchronisation), in eager mode and inside a CUDA graph alike, µs.
    p2p_step_us: float = 0.0
    #: Free-form source of the numbers.
    source: str = ""
    version: int = TOPOLOGY_VERSION

    def __post_init__(self) -> None:
        if self.version != TOPOLOGY_VERSION:
            raise ValueError(f"topology version {self.version} is not supported (this attnopt reads {TOPOLOGY_VERSION})")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"topology {self.name!r}: nodes and gpus_per_node must be >= 1")
        if self.fabric not in FABRICS:
            raise ValueError(f"unknown fabric {self.fabric!r}; valid: {', '.join(FABRICS)}")
        if self.nodes > 1 and self.inter.kind == "none":
            raise ValueError(f"topology {self.name!r} has {self.nodes} nodes but no inter-node link")
        if isinstance(self.intra, dict):
            object.__setattr__(self, "intra", Link(**self.intra))
        if isinstance(self.inter, dict):
            object.__setattr__(self, "inter", Link(**self.inter))

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """Devices in the topology."""
        return self.nodes * self.gpus_per_node

    def check_world(self, world: int) -> int:
        """``world`` if it fits, else ``ValueError`` that names the topology and its size."""
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        if world > self.world_size:
            raise ValueError(f"world size {world} is larger than topology {self.name!r} "
                             f"({self.nodes} node(s) x {self.gpus_per_node} GPU(s) = {self.world_size} devices)")
        return world

    def num_nodes(self, world: int | None = None) -> int:
        """Nodes that ``world`` ranks span (ranks fill nodes in order)."""
        world = self.check_world(world or self.world_size)
        return math.ceil(world / self.gpus_per_node)

    def nodes_for(self, world: int) -> int:
        """Alias of ``num_nodes(world)``."""
        return self.num_nodes(world)

    def split(self, world: int | None = None) -> tuple[int, int]:
        """(ranks per node, nodes) of ``world`` ranks: the intra/inter-node split of a hierarchical collective."""
        world = self.check_world(world or self.world_size)
        nodes = self.num_nodes(world)
        return min(world, self.gpus_per_node), nodes

    def rank_location(self, rank: int) -> tuple[int, int]:
        """(node, local GPU) of ``rank``."""
        return divmod(rank, self.gpus_per_node)

    # ------------------------------------------------------------------ the graph
    def graph(self):
        """A ``networkx.Graph``: vertices ``("gpu", rank)`` plus switch/host vertices; edge attributes
        ``kind``, ``bandwidth`` (GB/s per direction) and ``latency`` (µs, split evenly over a switch's two hops)."""
        return _build_graph(self)

    def path(self, a: int, b: int) -> tuple[float, float]:
        """(bottleneck bandwidth GB/s, latency µs) of the lowest-latency path between ranks ``a`` and ``b``."""
        import networkx as nx

        self.check_world(max(a, b) + 1)
        if a == b:
            return math.inf, 0.0
        g = self.graph()
        nodes = nx.shortest_path(g, ("gpu", a), ("gpu", b), weight="latency")
        edges = [g.edges[u, v] for u, v in zip(nodes, nodes[1:])]
        return min(e["bandwidth"] for e in edges), sum(e["latency"] for e in edges)

    def ring_bottleneck(self, world: int | None = None) -> tuple[float, float]:
        """(bandwidth GB/s, latency µs) of one step of a ring over ranks 0..world-1, all sending at once: the
        slowest hop's bandwidth (and, on a shared host path, its share) and the slowest hop's latency."""
        return _ring_bottleneck(self, self.check_world(world or self.world_size))

    def _ring_bottleneck_uncached(self, world: int) -> tuple[float, float]:
        if world == 1:
            return math.inf, 0.0
        bws, lats = [], []
        for r in range(world):
            bw, lat = self.path(r, (r + 1) % world)
            bws.append(bw)
            lats.append(lat)
        bw = min(bws)
        if self.fabric == "host":
            bw = bw / max(1, min(world, self.gpus_per_node) // 2)  # senders share the host link
        return bw, max(lats)

    def describe(self) -> str:
        inter = f", {self.inter.kind} {self.inter.gbps:g} GB/s across nodes" if self.nodes > 1 else ""
        return (f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {self.device}, "
                f"{self.intra.kind} {self.intra.gbps:g} GB/s ({self.fabric}){inter}")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Topology":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown topology field(s) {unknown}; valid: {sorted(names)}")
        data = dict(data)
        for key in ("intra", "inter"):
            if isinstance(data.get(key), dict):
                data[key] = Link(**data[key])
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        return cls.from_dict(json.loads(text))


@lru_cache(maxsize=1024)
def _ring_bottleneck(topo: Topology, world: int) -> tuple[float, float]:
    return topo._ring_bottleneck_uncached(world)


@lru_cache(maxsize=64)
def _build_graph(topo: Topology):
    import networkx as nx

    g = nx.Graph(name=topo.name)
    for r in range(topo.world_size):
        node, local = topo.rank_location(r)
        g.add_node(("gpu", r), node=node, local=local, device=topo.device)
    for node in range(topo.nodes):
        ranks = [node * topo.gpus_per_node + i for i in range(topo.gpus_per_node)]
        if topo.fabric == "mesh":
            for i, a in enumerate(ranks):
                for b in ranks[i + 1:]:
                    g.add_edge(("gpu", a), ("gpu", b), kind=topo.intra.kind, bandwidth=topo.intra.gbps,
                               latency=topo.intra.latency_us)
        else:
            hub = ("nvswitch" if topo.fabric == "switch" else "host", node)
            g.add_node(hub, node=node)
            for r in ranks:
                g.add_edge(("gpu", r), hub, kind=topo.intra.kind, bandwidth=topo.intra.gbps,
                           latency=topo.intra.latency_us / 2)
    if topo.nodes > 1:
        # Rail-optimised fabric: GPU i of every node has its own NIC on leaf switch ("rail", i); the rails meet
        # at a spine, so a cross-rail hop crosses one more switch.
        g.add_node(("spine", 0))
        for i in range(topo.gpus_per_node):
            g.add_node(("rail", i))
            g.add_edge(("rail", i), ("spine", 0), kind=topo.inter.kind, bandwidth=topo.inter.gbps * topo.nodes,
                       latency=topo.inter.latency_us / 2)
            for node in range(topo.nodes):
                g.add_edge(("gpu", node * topo.gpus_per_node + i), ("rail", i), kind=topo.inter.kind,
                           bandwidth=topo.inter.gbps, latency=topo.inter.latency_us / 2)
    return g


# --------------------------------------------------------------------------------------------- built-ins
#: NVLink 4 (H100/H200): 900 GB/s bidirectional = 450 GB/s per direction; P2P achieves about 390 GB/s
#: (fitted to the 2xH200 pass-KV ring reference in issue 5).
NVLINK4 = Link("nvlink", 390.0, 1.0)
#: InfiniBand NDR, 400 Gb/s = 50 GB/s per GPU; about 45 GB/s achieved.
IB_NDR = Link("ib", 45.0, 4.0)
#: PCIe 4.0 x16 without peer-to-peer (GeForce): through host memory, about 20 GB/s.
PCIE4_HOST = Link("pcie", 20.0, 8.0)
#: MI300X Infinity Fabric: a direct xGMI link per pair, 64 GB/s per direction, about 50 GB/s achieved.
XGMI3 = Link("xgmi", 50.0, 1.5)
#: gloo over the loopback device of one host (CPU ranks).
LOOPBACK = Link("ethernet", 5.0, 50.0)


#: NCCL send/recv ring steps over NVLink 4 and NVSwitch, every rank sending (this project's pass-KV ring in CUDA
#: graphs, benchmarks/results/multigpu-2xh200-stepgraph-0c072be.json and multigpu-4xh200-2026-11-22.json: 12
#: points of 67 MB-4.3 GB per step): a least-squares line gives 296 µs + bytes / 309 GB/s per step (2 GB steps
#: ran at 300-302 GB/s; 134 MB steps at 147-222 GB/s). The 390 GB/s of ``NVLINK4`` alone predicted these rings
#: 1.2-2.4x too fast. The DGX H100 has the same NVLink generation and switch, so it takes the same numbers.
NVLINK4_P2P_GBPS = 309.0
NVLINK4_P2P_STEP_US = 296.0


def _dgx(nodes: int) -> Topology:
    return Topology(f"dgx-h100x{nodes}", nodes=nodes, gpus_per_node=8, device="h100-sxm", intra=NVLINK4,
                    fabric="switch", inter=IB_NDR if nodes > 1 else NO_LINK, p2p_gbps=NVLINK4_P2P_GBPS,
                    # the step's ramp was measured inside one node; across nodes the IB hop binds (unmeasured)
                    p2p_step_us=NVLINK4_P2P_STEP_US if nodes == 1 else 0.0,
                    source="DGX H100: NVLink 4 via NVSwitch (900 GB/s), 8x 400 Gb/s NDR IB per node; P2P ring steps "
                           "inside a node as measured over NVLink 4 on the H200 machines")


def _h200(gpus: int) -> Topology:
    # The software latencies were measured on the lent 2xH200; the 4- and 8-GPU machines reuse them unmeasured
    # (NVSwitch, so a collective's hop latency does not grow with the ring), which issue 6's runs check.
    measured = "collective latencies measured (ENVIRONMENT.md)" if gpus == 2 else \
        "collective latencies taken from the 2xH200 measurements"
    return Topology(f"{gpus}x-h200-nvlink", nodes=1, gpus_per_node=gpus, device="h200", intra=NVLINK4,
                    fabric="switch", collective_us=20.5, graph_collective_us=7.2, small_msg_gbps=11.0,
                    graph_small_msg_gbps=57.0, p2p_us=20.0, p2p_gbps=NVLINK4_P2P_GBPS, p2p_step_us=NVLINK4_P2P_STEP_US,
                    source=f"the lent {gpus}xH200 (NV18, NVSwitch); {measured}; P2P ring steps measured on 2x and 4x")


BUILTIN_TOPOLOGIES: dict[str, Topology] = {
    "dgx-h100x1": _dgx(1),
    "dgx-h100x2": _dgx(2),
    "dgx-h100x16": _dgx(16),
    "2x4090-pcie": Topology("2x4090-pcie", nodes=1, gpus_per_node=2, device="rtx-4090", intra=PCIE4_HOST,
                            fabric="host", collective_us=30.0, graph_collective_us=12.0, small_msg_gbps=6.0,
                            graph_small_msg_gbps=15.0, p2p_us=30.0,
                            source="2x RTX 4090, PCIe 4.0 x16, no P2P (through host)"),
    "8x-mi300x": Topology("8x-mi300x", nodes=1, gpus_per_node=8, device="mi300x", intra=XGMI3, fabric="mesh",
                          collective_us=25.0, graph_collective_us=10.0, small_msg_gbps=10.0, graph_small_msg_gbps=40.0,
                          p2p_us=25.0, source="8x MI300X, Infinity Fabric full mesh (RCCL), datasheet"),
    **{_h200(n).name: _h200(n) for n in (2, 4, 8)},
}


def topology_names() -> list[str]:
    return sorted(BUILTIN_TOPOLOGIES) + ["local"]


def builtin_topology(name: str) -> Topology:
    try:
        return BUILTIN_TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; valid names: {', '.join(topology_names())}") from None


def resolve_topology(name: "str | Topology | None", world: int | None = None) -> Topology:
    """A ``Topology`` from a built-in name, ``"local"``/``None`` (detected), a ``.json`` path, or itself.

    For ``None``/``"local"`` with a ``world`` larger than the detected machine (several processes per device,
    gloo ranks on a CPU), the local topology is widened to ``world`` devices of the same link kind. A named
    topology is never widened: ``Topology.check_world`` raises when ``world`` does not fit.
    """
    if isinstance(name, Topology):
        return name
    if name is None or name == "local":
        topo = detect_topology()
        if world is not None and world > topo.world_size:
            topo = dataclasses.replace(topo, gpus_per_node=world, fabric="switch" if topo.fabric == "mesh" else topo.fabric,
                                       source=topo.source + f"; widened to {world} ranks on one node")
        return topo
    if name.endswith(".json"):
        from pathlib import Path

        try:
            return Topology.from_json(Path(name).read_text())
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"{name} is not a valid attnopt topology: {exc}") from None
    return builtin_topology(name)


# --------------------------------------------------------------------------------------------- detection
_NV = re.compile(r"^NV(\d+)$")


def parse_nvidia_smi_topo(text: str) -> tuple[int, str, int]:
    """(GPU count, link kind "nvlink"|"pcie", NVLink lanes between GPU0 and GPU1) from ``nvidia-smi topo -m``."""
    rows = [ln.split() for ln in text.splitlines() if re.match(r"^GPU\d+\s", ln)]  # the header row is indented
    rows = [r for r in rows if r and re.fullmatch(r"GPU\d+", r[0])]
    n = len(rows)
    if n == 0:
        raise ValueError("no GPU rows in nvidia-smi topo output")
    lanes = 0
    kind = "pcie"
    for r in rows:
        for cell in r[1:n + 1]:
            m = _NV.match(cell)
            if m:
                kind = "nvlink"
                lanes = max(lanes, int(m.group(1)))
    return n, kind, lanes


def topology_from_local(count: int, kind: str, lanes: int, device: str) -> Topology:
    """A one-node topology of ``count`` local GPUs."""
    if count <= 1:
        return Topology("local", nodes=1, gpus_per_node=1, device=device, intra=NVLINK4, source="one local device")
    if kind == "nvlink":
        gbps = min(NVLINK4.gbps, 25.0 * lanes * 0.87) if lanes else NVLINK4.gbps
        return Topology("local", nodes=1, gpus_per_node=count, device=device, intra=Link("nvlink", gbps, 1.0),
                        fabric="switch" if count > 2 or lanes >= 12 else "mesh",
                        source=f"detected: {count} GPUs, NVLink x{lanes}")
    return Topology("local", nodes=1, gpus_per_node=count, device=device, intra=PCIE4_HOST, fabric="host",
                    collective_us=30.0, graph_collective_us=12.0, small_msg_gbps=6.0, p2p_us=30.0,
                    source=f"detected: {count} GPUs over PCIe")


def detect_topology() -> Topology:
    """The local machine: ``nvidia-smi topo -m`` when present, else a one-node guess from
    ``torch.cuda.device_count()`` (NVLink for H100/H200-class parts, else PCIe); one device without a GPU."""
    import torch

    from attnopt.hardware import detect_profile

    if not torch.cuda.is_available():
        return Topology("local", nodes=1, gpus_per_node=1, device="cpu", intra=LOOPBACK, fabric="host",
                        collective_us=3000.0, graph_collective_us=3000.0, small_msg_gbps=1.0, graph_small_msg_gbps=1.0,
                        p2p_us=700.0, source="no GPU: gloo ranks on this host (ENVIRONMENT.md: ~6 ms all_reduce, "
                        "~0.7 ms P2P step with 4 ranks on 2 cores)")
    device = detect_profile().name
    count = torch.cuda.device_count()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
            n, kind, lanes = parse_nvidia_smi_topo(out)
            return topology_from_local(min(n, count) or n, kind, lanes, device)
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    name = torch.cuda.get_device_name(0).lower()
    kind = "nvlink" if any(s in name for s in ("h100", "h200", "a100", "b200")) and "pcie" not in name else "pcie"
    return topology_from_local(count, kind, 18 if kind == "nvlink" else 0, device)
