"""``HardwareProfile``: the frozen description of one accelerator that the cost model reads, its derived quantities,
its JSON round trip and the type and range checks of its fields. The built-ins, the calibrated-profile cache and the
resolution of the profile the planner uses are in ``hardware``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

#: Version of the profile JSON; a cached file with another version is ignored with a warning.
#: Version 2 (2026-11-23): SDPA flash with several query tokens has its own fitted factor (``dense/flash_rows``)
#: and model, and the memory latency is fitted; factors fitted to version 1's model would mis-scale it.
PROFILE_VERSION = 2
#: Default cap of one SM's read bandwidth, as a multiple of its fair share of the chip's bandwidth.
SM_SHARE_FACTOR = 2.5
#: Default L2-to-SM bandwidth as a multiple of the HBM read bandwidth (H100: about 5.5 TB/s against 3 TB/s).
L2_FACTOR = 1.75


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator as the cost model sees it.

    Bandwidths are in GB/s (1e9 bytes per second); times in microseconds. Every field round-trips through
    JSON (``to_json`` / ``from_json``); unknown fields are an error.
    """

    name: str
    #: Streaming multiprocessors (compute units on AMD).
    sm_count: int
    #: Sustained HBM read bandwidth, GB/s (decode attention only reads).
    hbm_read_gbps: float
    #: L2 cache size in bytes.
    l2_bytes: int
    #: Latency of one kernel launch, µs (the floor of any launch; a second dependent launch adds it again).
    launch_us: float
    #: Resident programs per SM for the decode kernels, by ``num_warps`` (the occupancy of each kernel
    #: configuration). A configuration missing here gets ``max(1, 16 // num_warps)``.
    occupancy: dict[int, int] = field(default_factory=lambda: {4: 4, 8: 2})
    #: Fraction of ``hbm_read_gbps`` the attnopt Triton kernels reach when the grid saturates the chip
    #: (2xH200 run of 2026-11-22: 16-way split-KV streamed 3.4 TB/s of a 4.17 TB/s read bandwidth with two
    #: programs per SM, 2.7 TB/s with one; ``mem_latency_us`` carries the difference).
    kernel_efficiency: float = 0.82
    #: Fixed cost per KV tile iteration of one program, µs (loop overhead, softmax rescale, dot issue) that
    #: memory does not hide.
    per_tile_us: float = 0.02
    #: Device memory latency under load, µs: with Little's law it gives the bandwidth one program reaches from
    #: the bytes it keeps in flight (``bytes_in_flight / mem_latency_us``). The default is what single programs
    #: streamed on an H100 (benchmarks/results/cost_model-nvidia-h100-80gb-hbm3.json, 1582468): 17-20 GB/s with
    #: 32 KB tiles (split-KV, 128-336 programs) and about 36 GB/s with 64 KB tiles (SDPA flash, q_len 4, 64
    #: programs), i.e. 1.7-1.9 µs; ``attnopt calibrate`` refits it (``MEM_LATENCY_GRID_US``).
    mem_latency_us: float = 2.0
    #: Most bandwidth one SM's programs draw together, GB/s; 0 = ``SM_SHARE_FACTOR`` x the fair share
    #: ``hbm_read_gbps / sm_count`` (a small grid cannot reach the chip's bandwidth).
    sm_read_gbps: float = 0.0
    #: Fraction of ``hbm_read_gbps`` that PyTorch's SDPA decode path (the dense plan) reaches when saturated
    #: (same run: flash SDPA read 262k-524k-token shards at 3.8-3.95 TB/s on an H200).
    dense_efficiency: float = 0.92
    #: Bandwidth from L2 to the SMs, GB/s; 0 = ``L2_FACTOR`` x ``hbm_read_gbps``. It bounds kernels whose
    #: programs re-read the same tiles (SDPA flash with several query tokens: one program per query head).
    l2_read_gbps: float = 0.0
    #: Tensor-core throughput of SDPA flash's forward kernel, counted as 128x128-row tiles at head_dim 128 (a
    #: smaller head runs no faster per tile), TFLOP/s. It bounds multi-token decode, where flash multiplies
    #: whole 128-row tiles for a few real rows. Fitted to the H100 calibration samples of 2026-11-23
    #: (benchmarks/results/calibration-samples-nvidia-h100-73d14e9.json: B=32/4, 64-128 query heads, D=64).
    mma_tflops: float = 800.0
    #: Device-to-device copy bandwidth (bytes read plus written), GB/s; 0 = not measured.
    copy_gbps: float = 0.0
    #: Device memory in bytes.
    memory_bytes: int = 0
    #: Shared memory one program may use, bytes (the device's opt-in maximum per block); 0 = Hopper's 232,448.
    #: It bounds the Triton kernels' tile configurations (``runtime/strategies/split_kv.py: smem_budget``).
    smem_per_block_bytes: int = 0
    #: How many times slower the Triton-kernel strategies (split-KV, stream-K) run than modelled, because
    #: they run as a pure-PyTorch partition-and-merge instead of a compiled kernel (the ``cpu`` profile).
    #: 1.0 where the kernels compile.
    emulation_slowdown: float = 1.0
    #: Whether the numbers were measured on this machine by ``attnopt calibrate``.
    calibrated: bool = False
    #: Free-form source of the numbers (datasheet, calibration date, ...).
    source: str = "datasheet"
    #: ``torch.cuda.get_device_name()`` of the device this profile describes ("" for datasheet built-ins).
    device_name: str = ""
    #: Extra constants fitted during calibration (e.g. the fit residuals per strategy).
    fitted: dict[str, float] = field(default_factory=dict)
    #: Schema version of the JSON form.
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field_type(self.name, f.name, f.type, getattr(self, f.name))
        if self.version != PROFILE_VERSION:
            raise ValueError(f"hardware profile version {self.version} is not supported (this attnopt reads {PROFILE_VERSION})")
        for name in ("sm_count", "hbm_read_gbps", "launch_us", "kernel_efficiency", "dense_efficiency",
                     "mem_latency_us", "emulation_slowdown", "mma_tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        if self.smem_per_block_bytes < 0:
            raise ValueError(f"hardware profile {self.name!r}: smem_per_block_bytes must be >= 0 (0 = Hopper's)")
        if self.per_tile_us < 0 or self.sm_read_gbps < 0 or self.l2_read_gbps < 0:
            raise ValueError(f"hardware profile {self.name!r}: per_tile_us, sm_read_gbps and l2_read_gbps must be >= 0")
        if not self.occupancy or any(int(k) <= 0 or int(v) <= 0 for k, v in self.occupancy.items()):
            raise ValueError(f"hardware profile {self.name!r}: occupancy must map num_warps > 0 to programs > 0")

    # ------------------------------------------------------------------ derived quantities
    def programs_per_sm(self, num_warps: int = 4) -> int:
        """Resident programs per SM for a kernel with ``num_warps`` warps."""
        return int(self.occupancy.get(num_warps, max(1, 16 // max(num_warps, 1))))

    def sm_gbps(self) -> float:
        """The bandwidth cap of one SM, GB/s (``sm_read_gbps`` or the default share)."""
        return self.sm_read_gbps if self.sm_read_gbps > 0 else SM_SHARE_FACTOR * self.hbm_read_gbps / self.sm_count

    def l2_gbps(self) -> float:
        """The L2-to-SM bandwidth, GB/s (``l2_read_gbps`` or ``L2_FACTOR`` x the HBM read bandwidth)."""
        return self.l2_read_gbps if self.l2_read_gbps > 0 else L2_FACTOR * self.hbm_read_gbps

    def slots(self, num_warps: int = 4) -> int:
        """Programs the whole chip runs at once (one wave)."""
        return self.sm_count * self.programs_per_sm(num_warps)

    def describe(self) -> str:
        """The string plan reports carry: name, and whether it was calibrated."""
        return self.name + (" (calibrated)" if self.calibrated else " (uncalibrated)")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["occupancy"] = {str(k): v for k, v in self.occupancy.items()}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HardwareProfile":
        if not isinstance(data, dict):
            raise ValueError(f"a hardware profile is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown hardware profile field(s) {unknown}; valid: {sorted(names)}")
        data = dict(data)
        if isinstance(data.get("occupancy"), dict):  # JSON keys are strings; anything else fails the type check
            data["occupancy"] = {_int_key(k): v for k, v in data["occupancy"].items()}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)


def _int_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.strip().isdigit() else key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_field_type(profile: str, name: str, annotation: str, value: Any) -> None:
    """``TypeError`` unless ``value`` fits the field's annotation: ``int`` (not a bool, not 1.5), ``float`` (a finite
    number: a JSON ``Infinity`` or ``NaN`` is not a bandwidth), ``str``, ``bool``, ``dict[int, int]`` (occupancy)
    or ``dict[str, float]`` (fitted constants)."""
    ok = {"int": _is_int, "float": _is_number, "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
          "dict[int, int]": lambda v: isinstance(v, dict) and all(_is_int(k) and _is_int(x) for k, x in v.items()),
          "dict[str, float]": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_number(x)
                                                                     for k, x in v.items())}[annotation]
    if not ok(value):
        want = {"float": "a finite number", "dict[int, int]": "an object of num_warps -> programs (integers)",
                "dict[str, float]": "an object of names -> finite numbers"}.get(annotation, f"a{'n' if annotation == 'int' else ''} {annotation}")
        raise TypeError(f"hardware profile {profile!r}: {name} must be {want}, got {type(value).__name__} {value!r}")
