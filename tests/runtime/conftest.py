"""Fixtures of the kernel tests."""
import pytest
import torch


@pytest.fixture(params=[pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
def kernel_device(request) -> torch.device:
    """Each kernel test's device: the CPU under the Triton interpreter, and CUDA where there is a GPU; else skip."""
    from attnopt.runtime.kernels import interpreting

    if not (torch.cuda.is_available() if request.param == "cuda" else interpreting()):
        pytest.skip("needs CUDA" if request.param == "cuda" else "needs the Triton interpreter (TRITON_INTERPRET=1)")
    return torch.device(request.param)
