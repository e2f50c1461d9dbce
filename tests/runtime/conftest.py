import pytest
import torch


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
