"""Hardware gating and the Triton interpreter switch.

``ATTNOPT_STRICT=1``: the passes' bugs raise in every test. ``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` runs, so it is set here, at import, when no GPU
is present. GPU-only tests carry ``@pytest.mark.cuda`` / ``@pytest.mark.multigpu`` and are skipped without one.
"""
import os
from types import SimpleNamespace

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A crash inside attnopt's passes fails the test instead of leaving the site alone (config.on_error="fallback"
# would hide it); tests of the fallback itself unset it.
os.environ.setdefault("ATTNOPT_STRICT", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (marker 'cuda'); none on this machine")
    skip_multi = pytest.mark.skip(reason="needs >= 2 CUDA GPUs (marker 'multigpu')")
    ngpu = torch.cuda.device_count() if HAS_CUDA else 0
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def inner_compiles(monkeypatch):
    """Every call of ``attnopt.backend._compile_inner`` (the inner backend's compile of a rewritten graph), recorded
    in order as a namespace with ``name``, ``gm``, ``example_inputs`` and ``mode``, and passed on unchanged."""
    import attnopt.backend as backend_module

    calls = []
    inner = backend_module._compile_inner

    def recording(name, gm, example_inputs, mode):
        calls.append(SimpleNamespace(name=name, gm=gm, example_inputs=example_inputs, mode=mode))
        return inner(name, gm, example_inputs, mode)

    monkeypatch.setattr(backend_module, "_compile_inner", recording)
    return calls
