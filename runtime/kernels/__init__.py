"""Triton kernels: each file holds a private ``_name_kernel`` and one launcher.

Importing this package does not import Triton; ``triton_usable`` says whether the kernels can run.
"""
from __future__ import annotations

import functools
import importlib.util
import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device_type: str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device_type``: compiled on CUDA, interpreted on CPU."""
    if not _triton_importable():
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and interpreting()
