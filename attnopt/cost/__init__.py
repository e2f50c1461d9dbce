"""The cost model: kernel cost (bytes, waves, merges, launches) and collective cost (α-β over a topology).

``kernel`` prices the single-device plans (dense SDPA, split-KV, stream-K) from the bytes ``traffic`` counts;
``collective`` prices NCCL collectives and P2P ring steps over an ``attnopt.topology.Topology`` and the tree and
ring decode plans. Neither imports anything from ``attnopt.runtime``, so both work without a GPU or Triton.
"""
from . import collective, kernel  # noqa: F401
