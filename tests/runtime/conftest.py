"""Fixtures of the runtime tests."""
import pytest
import torch


@pytest.fixture(params=[pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
def kernel_device(request) -> torch.device:
    """Each kernel test's device: the CPU under the Triton interpreter, and CUDA where there is a GPU; else skip."""
    from attnopt.runtime.kernels import interpreting

    if not (torch.cuda.is_available() if request.param == "cuda" else interpreting()):
        pytest.skip("needs CUDA" if request.param == "cuda" else "needs the Triton interpreter (TRITON_INTERPRET=1)")
    return torch.device(request.param)


@pytest.fixture
def saap_tiny_llama():
    """A tiny random Llama (3 layers, 6/2 heads of dim 64, SDPA attention) made after ``torch.manual_seed(0)``:
    the SAAP end-to-end tests' model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=192, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=64, num_hidden_layers=3, vocab_size=97, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model
