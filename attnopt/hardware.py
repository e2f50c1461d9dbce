"""Hardware profiles for the cost model.

A ``HardwareProfile`` (``hardware_profile``) is a frozen description of one accelerator: what the cost model needs
to predict a decode-attention kernel's time. Built-ins come from datasheets and are marked ``calibrated=False``;
``attnopt calibrate`` measures the local GPU and caches a calibrated profile under the user cache directory
(``<cache>/attnopt/profiles/<device-name>.json``, see ``profile_cache_dir``).

``resolve_profile(None)`` is what the planner uses: the calibrated profile of the local GPU when one is
cached, else the datasheet built-in that matches the device name, else ``cpu`` on a machine without a GPU.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

from .hardware_profile import PROFILE_VERSION, HardwareProfile

#: Environment variable that overrides the cache directory (tests, shared clusters).
CACHE_ENV = "ATTNOPT_CACHE_DIR"

_GiB = 1 << 30
_MiB = 1 << 20

#: ``kernel_efficiency`` of the Hopper built-ins: the split-KV kernel with TMA tiles and three pipeline stages
#: streams at the read bandwidth these profiles assume. H100 (benchmarks/results/kernels-nvidia-h100-80gb-hbm3.json,
#: 847be08): 32/8 heads, D=128, 512k in 692 us, 3.10 TB/s; H200 (experiments/local-split-kv-graph-2xh200-4d8dfbc.json):
#: a 64k shard in 68.3 us, 3.93 TB/s, 0.94 of 4.17. At the default 0.82 an uncalibrated H100 planned dense (SDPA flash)
#: for 9 of the 10 bench cases, measured 1.01-2.24x slower than the fastest plan; at 0.95 it plans split-KV for all
#: 10, and the bench at 41a0dfd measured its picks at 1.00-1.08x the fastest attnopt plan, faster than SDPA flash in 9
#: (the 56-head MHA pick, 337.9 us, is 7.6 % slower than flash: the datasheet model cannot rank those grids).
HOPPER_KERNEL_EFFICIENCY = 0.95

#: Datasheet built-ins. Read bandwidths are the datasheet peak times a typical achieved fraction, except the
#: H200's, which was measured on the lent machine (ENVIRONMENT.md: 4.17 TB/s read-only).
BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "h100-sxm": HardwareProfile("h100-sxm", sm_count=132, hbm_read_gbps=3350 * 0.92, l2_bytes=50 * _MiB,
                                launch_us=4.3, copy_gbps=3020.0, memory_bytes=80 * _GiB, smem_per_block_bytes=232448,
                                kernel_efficiency=HOPPER_KERNEL_EFFICIENCY,
                                source="datasheet 3.35 TB/s x 0.92; copy 3.02 TB/s and launch 4.3 us measured"),
    "h100-pcie": HardwareProfile("h100-pcie", sm_count=114, hbm_read_gbps=2000 * 0.9, l2_bytes=50 * _MiB,
                                 launch_us=4.5, memory_bytes=80 * _GiB, smem_per_block_bytes=232448,
                                 source="datasheet 2.0 TB/s x 0.9"),
    "h200": HardwareProfile("h200", sm_count=132, hbm_read_gbps=4170, l2_bytes=50 * _MiB, launch_us=4.3,
                            memory_bytes=141 * _GiB, kernel_efficiency=HOPPER_KERNEL_EFFICIENCY, smem_per_block_bytes=232448,
                            source="datasheet 4.8 TB/s; read 4.17 TB/s measured here"),
    "a100-80gb": HardwareProfile("a100-80gb", sm_count=108, hbm_read_gbps=2039 * 0.9, l2_bytes=40 * _MiB,
                                 launch_us=5.0, occupancy={4: 3, 8: 2}, memory_bytes=80 * _GiB,
                                 smem_per_block_bytes=166912, source="datasheet 2.04 TB/s x 0.9"),
    "rtx-4090": HardwareProfile("rtx-4090", sm_count=128, hbm_read_gbps=1008 * 0.9, l2_bytes=72 * _MiB,
                                launch_us=4.0, occupancy={4: 3, 8: 1}, memory_bytes=24 * _GiB,
                                smem_per_block_bytes=101376, source="datasheet 1.01 TB/s x 0.9"),
    "mi300x": HardwareProfile("mi300x", sm_count=304, hbm_read_gbps=5300 * 0.8, l2_bytes=256 * _MiB,
                              launch_us=6.0, occupancy={4: 2, 8: 1}, mem_latency_us=1.2, memory_bytes=192 * _GiB,
                              smem_per_block_bytes=65536,
                              source="datasheet 5.3 TB/s x 0.8 (256 MB Infinity Cache as L2)"),
    # No GPU: the kernel strategies run as a pure-PyTorch partition-and-merge (several eager ops per
    # partition), far slower than one fused SDPA call, so dense must win unless a plan is forced.
    "cpu": HardwareProfile("cpu", sm_count=2, hbm_read_gbps=20.0, l2_bytes=32 * _MiB, launch_us=10.0,
                           occupancy={4: 1, 8: 1}, kernel_efficiency=0.5, dense_efficiency=0.5, per_tile_us=0.0,
                           mem_latency_us=0.1, emulation_slowdown=6.0,
                           source="generic CPU: kernels emulated in PyTorch"),
}

#: Substrings of ``torch.cuda.get_device_name()`` (lower case) that select a built-in, checked in order.
_NAME_MATCH = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100", "a100-80gb"),
               ("4090", "rtx-4090"), ("mi300", "mi300x"))


def builtin_names() -> list[str]:
    return sorted(BUILTIN_PROFILES)


def builtin_profile(name: str) -> HardwareProfile:
    """The datasheet profile called ``name``; ``ValueError`` lists the valid names."""
    try:
        return BUILTIN_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; valid names: {', '.join(builtin_names())} "
                         "(or 'local', or a path to a profile .json)") from None


# --------------------------------------------------------------------------------------------- the cache
def profile_cache_dir() -> Path:
    """``$ATTNOPT_CACHE_DIR/profiles`` when set, else ``<platformdirs user cache>/attnopt/profiles``
    (``$XDG_CACHE_HOME`` or ``~/.cache`` when platformdirs is not installed)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        try:
            import platformdirs

            root = platformdirs.user_cache_dir("attnopt")
        except ImportError:  # the GPU images lack platformdirs: use the XDG default it would give on Linux
            root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnopt")
    return Path(root) / "profiles"


def _slug(device_name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", device_name.strip()).strip("-")
    if not slug:
        raise ValueError(f"cannot make a cache file name from device name {device_name!r}")
    return slug


def cached_profile_path(device_name: str) -> Path:
    """Where the calibrated profile of ``device_name`` (``torch.cuda.get_device_name()``) lives."""
    return profile_cache_dir() / f"{_slug(device_name)}.json"


def save_profile(profile: HardwareProfile, device_name: str | None = None) -> Path:
    """Write ``profile`` to the cache under ``device_name`` (default ``profile.device_name``); return the path."""
    name = device_name or profile.device_name or profile.name
    path = cached_profile_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(path)
    return path


def cached_profile_names() -> list[str]:
    """The calibrated profiles in the cache, by file stem (``NVIDIA-H100-80GB-HBM3``); ``hardware=`` takes them."""
    try:
        return sorted(p.stem for p in profile_cache_dir().glob("*.json") if p.is_file())
    except OSError:
        return []


def load_profile_file(path: str | os.PathLike) -> HardwareProfile:
    """Read a profile JSON file; ``ValueError`` names the file when it is not a valid profile."""
    p = Path(path)
    try:
        return HardwareProfile.from_json(p.read_text())
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise ValueError(f"{p} is a directory, not an attnopt hardware profile") from None
    except (json.JSONDecodeError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p} is not a valid attnopt hardware profile: {exc}") from None


def load_cached_profile(device_name: str) -> HardwareProfile | None:
    """The cached calibrated profile of ``device_name``, or ``None``.

    A corrupt or unreadable file is ignored with a ``UserWarning`` that says so and names the file.
    """
    path = cached_profile_path(device_name)
    if not path.exists():
        return None
    try:
        version = json.loads(path.read_text()).get("version")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        version = None
    if isinstance(version, int) and version < PROFILE_VERSION:
        warnings.warn(f"ignoring the calibrated hardware profile {path}: it was fitted to an older cost model "
                      f"(profile version {version}; this attnopt reads {PROFILE_VERSION}). Run `attnopt calibrate` "
                      "again, or `attnopt calibrate --from-samples FILE` if you kept its measurements.",
                      UserWarning, stacklevel=2)
        return None
    try:
        return HardwareProfile.from_json(path.read_text())
    except (OSError, TypeError, ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        reason = " ".join(str(exc).split())
        warnings.warn(f"ignoring the corrupt calibrated hardware profile {path}: {reason}; using the built-in "
                      "profile. Run `attnopt calibrate` again to replace it.", UserWarning, stacklevel=2)
        return None


# --------------------------------------------------------------------------------------------- detection
def profile_for_device_name(device_name: str, sm_count: int | None = None, memory_bytes: int | None = None,
                            l2_bytes: int | None = None, smem_per_block_bytes: int | None = None) -> HardwareProfile:
    """The built-in that matches a CUDA device name (SM count, memory and shared memory per block taken from the
    device), or a generic guess for an unknown GPU."""
    lname = device_name.lower()
    for needle, key in _NAME_MATCH:
        if needle in lname:
            base = BUILTIN_PROFILES[key]
            changes: dict[str, Any] = {"device_name": device_name}
            if sm_count:
                changes["sm_count"] = int(sm_count)
            if memory_bytes:
                changes["memory_bytes"] = int(memory_bytes)
            if l2_bytes:
                changes["l2_bytes"] = int(l2_bytes)
            if smem_per_block_bytes:
                changes["smem_per_block_bytes"] = int(smem_per_block_bytes)
            return dataclasses.replace(base, **changes)
    # an unknown GPU's tiles must fit its own shared memory: without the device's number, a pre-Hopper block's
    # 48 KB (the most any CUDA GPU gives without opting in), not Hopper's 227 KB
    return HardwareProfile(_slug(device_name).lower(), sm_count=int(sm_count or 80), hbm_read_gbps=1000.0,
                           l2_bytes=int(l2_bytes or 40 * _MiB), launch_us=5.0, memory_bytes=int(memory_bytes or 0),
                           smem_per_block_bytes=int(smem_per_block_bytes or 48 * 1024),
                           device_name=device_name, source="unknown GPU: generic guesses; run `attnopt calibrate`")


def detect_profile() -> HardwareProfile:
    """The datasheet profile of the local accelerator (GPU 0), from ``torch.cuda.get_device_properties``;
    ``cpu`` without a GPU. Ignores the calibrated cache (``resolve_profile`` reads it)."""
    import torch

    if not torch.cuda.is_available():
        return BUILTIN_PROFILES["cpu"]
    props = torch.cuda.get_device_properties(0)
    return profile_for_device_name(props.name, props.multi_processor_count, props.total_memory,
                                   getattr(props, "L2_cache_size", None),
                                   getattr(props, "shared_memory_per_block_optin", None))


def local_device_name() -> str | None:
    """``torch.cuda.get_device_name(0)``, or ``None`` without a GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def resolve_profile(name: str | None = None) -> HardwareProfile:
    """The profile the planner uses.

    Parameters
    ----------
    name
        ``None`` or ``"local"``: the calibrated profile of the local GPU when cached (a corrupt cache file is
        ignored with a warning), else the detected datasheet profile, else ``cpu`` without a GPU.
        A built-in name (``h100-sxm``, ``h200``, ``a100-80gb``, ``rtx-4090``, ``mi300x``, ``cpu``, ...):
        that datasheet profile. The name of a calibrated profile in the cache (``cached_profile_names``): that
        profile. A path ending in ``.json``: that profile file.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the valid names) or an invalid profile file.
    """
    if name is None or name == "local":
        device = local_device_name()
        if device is not None:
            cached = load_cached_profile(device)
            if cached is not None:
                return cached
        return detect_profile()
    if name.endswith(".json"):
        return load_profile_file(name)
    if name not in BUILTIN_PROFILES and name in cached_profile_names():
        return load_profile_file(profile_cache_dir() / f"{name}.json")
    return builtin_profile(name)
