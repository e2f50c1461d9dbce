"""Hand-written transformers (no Hugging Face): a nanoGPT-style model with its own KV cache, and one written
with ``torch.einsum``. Decode steps through ``attnopt.optimize`` must match the original module exactly (fp32
tolerance), and every attention layer's decode site must be rewritten and executed.

The models keep their KV cache as plain tensors passed in and returned (nanoGPT with a cache), so the decode
graph sees ``cat(past, new)`` with a KV length that dynamo makes symbolic after the first decode step.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attnopt
from attnopt.runtime.ops import CALL_COUNTS

ATOL = RTOL = 1e-5
VOCAB = 97


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ nanoGPT
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention with a KV cache and optional GQA (``repeat_interleave`` of the KV heads).

    ``impl``:
      * ``"sdpa"``: ``F.scaled_dot_product_attention(is_causal=T > 1)`` (causal only for the prefill);
      * ``"manual"``: ``(q @ k^T) * (1/sqrt(D))``, ``masked_fill(bias == 0, -inf)`` from a ``tril`` buffer,
        softmax, ``@ v`` (nanoGPT's slow path);
      * ``"sdpa_mask"``: SDPA with an explicit boolean mask sliced from the ``tril`` buffer.
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, block_size: int, impl: str):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.impl = n_head, n_kv_head, n_embd // n_head, impl
        self.c_attn = nn.Linear(n_embd, (n_head + 2 * n_kv_head) * self.head_dim)
        self.c_proj = nn.Linear(n_head * self.head_dim, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
                             persistent=False)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None, pos: int):
        B, T, _ = x.shape
        D, H, Hkv = self.head_dim, self.n_head, self.n_kv_head
        q, k, v = self.c_attn(x).split([H * D, Hkv * D, Hkv * D], dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, Hkv, D).transpose(1, 2)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        N = k.shape[2]
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        elif self.impl == "sdpa_mask":
            mask = self.bias[:, :, pos:pos + T, :N].bool()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
            att = att.masked_fill(self.bias[:, :, pos:pos + T, :N] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, H * D)
        return self.c_proj(y), present


class Block(nn.Module):
    def __init__(self, n_embd, n_head, n_kv_head, block_size, impl):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, n_kv_head, block_size, impl)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, past, pos):
        a, present = self.attn(self.ln_1(x), past, pos)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class NanoGPT(nn.Module):
    def __init__(self, impl: str, n_layer: int = 2, n_embd: int = 96, n_head: int = 6, n_kv_head: int = 2,
                 block_size: int = 128):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, n_kv_head, block_size, impl) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, past: list | None = None, pos: int = 0):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(pos, pos + T, device=idx.device))
        presents = []
        for i, block in enumerate(self.h):
            x, present = block(x, past[i] if past is not None else None, pos)
            presents.append(present)
        return self.lm_head(self.ln_f(x)), presents


# ------------------------------------------------------------------------------------------------ einsum
class EinsumAttention(nn.Module):
    """Multi-head attention written with ``torch.einsum``; the scale is a division, the padding mask additive.

    ``layout``: ``"bhnd"`` keeps the cache as (B, H, N, D) (``"bhqd,bhkd->bhqk"``); ``"bhdn"`` keeps K
    pre-transposed as (B, H, D, N) (``"bhqd,bhdk->bhqk"``).
    """

    def __init__(self, dim: int, heads: int, layout: str):
        super().__init__()
        self.heads, self.head_dim, self.layout = heads, dim // heads, layout
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, past, pad_bias):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.layout == "bhdn":
            k = k.transpose(-1, -2)
        if past is not None:
            k = torch.cat([past[0], k], dim=-1 if self.layout == "bhdn" else -2)
            v = torch.cat([past[1], v], dim=-2)
        if self.layout == "bhdn":
            scores = torch.einsum("bhqd,bhdk->bhqk", q, k) / math.sqrt(self.head_dim)
        else:
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        scores = scores + pad_bias
        probs = scores.softmax(dim=-1)
        y = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return self.out(y.transpose(1, 2).reshape(B, T, C)), (k, v)


class EinsumLM(nn.Module):
    def __init__(self, layout: str = "bhnd", n_layer: int = 2, dim: int = 64, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(EinsumAttention(dim, heads, layout) for _ in range(n_layer))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(n_layer))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, past=None, valid=None):
        """``valid``: (B, N) bool, False for left-padding positions of the whole cache including this step."""
        x = self.emb(idx)
        T = idx.shape[1]
        N = valid.shape[1]
        allowed = valid[:, None, None, :].expand(-1, 1, T, N)
        if T > 1:
            # Prefill (T == N): causal as well, and a padding query sees itself, so no row is fully masked (NaN).
            allowed = allowed & torch.ones(T, N, dtype=torch.bool, device=idx.device).tril(N - T)
            allowed = allowed | torch.eye(T, N, dtype=torch.bool, device=idx.device)
        pad_bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
        presents = []
        for i, (norm, layer) in enumerate(zip(self.norms, self.layers)):
            a, present = layer(norm(x), past[i] if past is not None else None, pad_bias)
            x = x + a
            presents.append(present)
        return self.head(x), presents


# ------------------------------------------------------------------------------------------------ helpers
def decode_loop(step, ids: torch.Tensor, steps: int, extra):
    """Greedy decode with an explicit cache; returns (tokens, per-step logits)."""
    with torch.no_grad():
        logits, past = step(ids, None, **extra(0, ids.shape[1]))
        pos = ids.shape[1]
        tokens, all_logits = [], []
        for _ in range(steps):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits, past = step(nxt, past, **extra(pos, 1))
            all_logits.append(logits[:, -1])
            pos += 1
    return torch.cat(tokens, dim=1), all_logits


def assert_rewritten_and_ran(optimized, n_layers: int, decode_steps: int, before):
    report = attnopt.last_plans(optimized)
    decode = [s for s in report.sites if s.site.q_len == 1]
    untouched = [(s.site.node, s.reason_untouched) for s in decode if not s.rewritten]
    assert decode and not untouched, f"{untouched}\n{report.format_table()}"
    graphs = {s.key.split(":")[0] for s in decode}
    assert len(decode) == n_layers * len(graphs), report.format_table()
    ran = sum(CALL_COUNTS[s.key] - before.get(s.key, 0) for s in decode)
    assert ran == n_layers * decode_steps, (ran, n_layers, decode_steps)
    for s in report.sites:
        if s.site.q_len != 1:  # the prefill (q_len == kv_len) is never rewritten
            assert not s.rewritten, s
    return report


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "manual", "sdpa_mask"])
@pytest.mark.parametrize("n_kv_head", [6, 2], ids=["mha", "gqa3"])
def test_nanogpt_decode(impl, n_kv_head):
    torch.manual_seed(0)
    model = NanoGPT(impl, n_kv_head=n_kv_head).eval()
    optimized = attnopt.optimize(model, inner_backend="eager")
    ids = torch.randint(0, VOCAB, (2, 19))
    no_extra = lambda pos, t: {"pos": pos}  # noqa: E731
    ref_tokens, ref_logits = decode_loop(model, ids, 12, extra=no_extra)
    before = CALL_COUNTS.copy()
    tokens, logits = decode_loop(optimized, ids, 12, extra=no_extra)
    assert torch.equal(tokens, ref_tokens)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    report = assert_rewritten_and_ran(optimized, n_layers=2, decode_steps=12, before=before)
    if n_kv_head != 6:
        # GQA via repeat_interleave: the op must read the un-expanded cache.
        assert {s.site.kv_heads for s in report.rewritten} == {n_kv_head}
        assert {s.site.gqa_source for s in report.rewritten} == {"repeat_interleave"}


@pytest.mark.slow
def test_nanogpt_is_causal_top_left_at_decode():
    """nanoGPT's classic mistake: ``is_causal=True`` at decode. PyTorch aligns the causal mask top-left, so the
    single query sees only the first key. attnopt must reproduce that, not "fix" it."""

    class TopLeft(CausalSelfAttention):
        def forward(self, x, past, pos):
            B, T, _ = x.shape
            D, H = self.head_dim, self.n_head
            q, k, v = self.c_attn(x).split([H * D, H * D, H * D], dim=2)
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
            if past is not None:
                k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, H * D)), (k, v)

    torch.manual_seed(0)
    model = NanoGPT("sdpa", n_kv_head=6).eval()
    for block in model.h:
        old = block.attn
        block.attn = TopLeft(96, 6, 6, 128, "sdpa")
        block.attn.load_state_dict(old.state_dict())
    optimized = attnopt.optimize(model, inner_backend="eager")
    ids = torch.randint(0, VOCAB, (1, 9))
    no_extra = lambda pos, t: {"pos": pos}  # noqa: E731
    ref_tokens, ref_logits = decode_loop(model, ids, 6, extra=no_extra)
    before = CALL_COUNTS.copy()
    tokens, logits = decode_loop(optimized, ids, 6, extra=no_extra)
    assert torch.equal(tokens, ref_tokens)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    report = attnopt.last_plans(optimized)
    decode = [s for s in report.sites if s.site.q_len == 1]
    assert len(decode) >= 2
    for s in decode:
        assert s.site.is_causal
        if s.rewritten:
            assert CALL_COUNTS[s.key] - before.get(s.key, 0) > 0
        else:
            assert s.reason_untouched, s


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bhnd", "bhdn"])
def test_einsum_decode(layout):
    """Einsum attention with a (B, H, N, D) cache, or with K kept pre-transposed as (B, H, D, N)."""
    torch.manual_seed(0)
    model = EinsumLM(layout).eval()
    optimized = attnopt.optimize(model, inner_backend="eager")
    B, T, steps = 2, 11, 10
    ids = torch.randint(0, VOCAB, (B, T))
    # Row 1 is left-padded by 3 positions: an additive 0/-inf padding mask on every step.
    valid_full = torch.ones(B, T + steps, dtype=torch.bool)
    valid_full[1, :3] = False
    extra = lambda pos, t: {"valid": valid_full[:, :pos + t]}  # noqa: E731
    ref_tokens, ref_logits = decode_loop(model, ids, steps, extra=extra)
    before = CALL_COUNTS.copy()
    tokens, logits = decode_loop(optimized, ids, steps, extra=extra)
    assert torch.equal(tokens, ref_tokens)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    report = assert_rewritten_and_ran(optimized, n_layers=2, decode_steps=steps, before=before)
    assert {s.site.pattern for s in report.rewritten} == {"eager_einsum"}
    assert {s.site.mask_kind for s in report.rewritten} <= {"valid_length", "arbitrary"}


class SeqMajorEinsum(EinsumAttention):
    """The cache in sequence-major layout (B, N, H, D), contracted by ``"bqhd,bkhd->bhqk"``."""

    def forward(self, x, past, pad_bias):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)  # (B, T, H, D)
        if past is not None:
            k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim) + pad_bias
        y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return self.out(y.reshape(B, T, C)), (k, v)


@pytest.mark.slow
def test_einsum_seq_major_is_explained():
    """An einsum form attnopt does not rewrite: a sequence-major cache (``"bqhd,bkhd->bhqk"``). Every site is
    left alone with a reason naming the einsum, and the optimized model still runs exactly."""
    reason = "einsum"
    torch.manual_seed(0)
    model = EinsumLM("bhnd").eval()
    for i, old in enumerate(model.layers):
        model.layers[i] = SeqMajorEinsum(64, 4, "bhnd")
        model.layers[i].load_state_dict(old.state_dict())
    optimized = attnopt.optimize(model, inner_backend="eager")
    ids = torch.randint(0, VOCAB, (1, 7))
    valid_full = torch.ones(1, 7 + 5, dtype=torch.bool)
    extra = lambda pos, t: {"valid": valid_full[:, :pos + t]}  # noqa: E731
    ref_tokens, ref_logits = decode_loop(model, ids, 5, extra=extra)
    tokens, logits = decode_loop(optimized, ids, 5, extra=extra)
    assert torch.equal(tokens, ref_tokens)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    report = attnopt.last_plans(optimized)
    # Every graph has one site per layer, all left alone: the prefill as prefill (or for the layout), every
    # decode site for the layout.
    assert len(report.sites) >= 2 * len(model.layers), report.format_table()
    explained = 0
    for s in report.sites:
        why = s.reason_untouched or ""
        assert not s.rewritten and (reason in why or "prefill" in why), (s.site, why)
        explained += reason in why
    assert explained >= len(model.layers), report.format_table()
