"""Split-KV over a mask with no valid length (``runtime/kernels/mask_tiles.py``): each split owns every S-th tile,
reads the mask over them and attends only to the tiles where some row of its query tile sees a key.

Against the fp64 reference (``runtime/reference.py``) in the Triton interpreter (and on a GPU where there is one):
static-cache prefixes per batch row with the unused slots poisoned, holes that hide whole tiles (poisoned: a
hidden tile must not be read), every mask shape that broadcasts to (B, Hq, L, N), bool and additive (-inf, and
finfo.min, which hides nothing), fully masked rows, with and without a causal flag and a valid length.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnopt.runtime.reference import attention_states, sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels.mask_tiles import chunk_tiles, scan_rows  # noqa: E402
from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402

BN = 16


def _qkv(B, Hkv, G, L, N, D, dtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dev, dtype) for h, n in ((Hkv * G, L), (Hkv, N), (Hkv, N)))
    return q, k, v


def _split_kv(q, k, v, mask, splits, block_n=BN, valid_len=None, is_causal=False, fused=False, mask_tiles=None):
    """split_kv_decode with TMA asked for (the interpreter emulates the copy engine) into NaN-poisoned outputs."""
    B, Hq, L, _ = q.shape
    out = torch.full((B, Hq, L, v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, L), float("nan"), dtype=torch.float32, device=q.device)
    split_kv_decode(q, k, v, out, lse, workspace=split_kv_workspace(splits, q, k, v), attn_mask=mask,
                    valid_len=valid_len, is_causal=is_causal, num_splits=splits, block_n=block_n, fused_merge=fused,
                    tma=True, mask_tiles=mask_tiles)
    return out, lse


def _assert_matches(out, lse, q, k, v, tol, **kw):
    """``out`` and ``lse`` equal the fp64 reference (rows with no visible key: 0 and -inf) and hold no NaN."""
    ref = sdpa_float64(q, k, v, **kw)
    _, ref_lse = attention_states(q, k, v, compute_dtype=torch.float64, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the output"
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"max abs error {err:.3e}"
    assert bool((torch.isneginf(lse) == torch.isneginf(ref_lse)).all()), "rows with no visible key differ"
    finite = ~torch.isneginf(ref_lse)
    assert (lse.double() - ref_lse)[finite].abs().max().item() < 2e-3 if finite.any() else True


def test_static_cache_prefixes_read_nothing_past_the_last_visible_key(kernel_device):
    _static_prefixes(kernel_device)


def test_hidden_tiles_are_not_read(kernel_device):
    _hidden_tiles(kernel_device)


def test_several_chunks_of_tiles(kernel_device, monkeypatch):
    """A split classifies its tiles a chunk at a time (``CHUNK_ELEMENTS``): with chunks of two tiles, the cases
    above run several chunks per split, with kept tiles in some and none in others."""
    from attnopt.runtime.kernels import mask_tiles

    monkeypatch.setattr(mask_tiles, "CHUNK_ELEMENTS", 2 * BN)
    assert chunk_tiles(9 * BN, 1, BN) == (2, False)
    _static_prefixes(kernel_device)
    _hidden_tiles(kernel_device)


def _static_prefixes(dev):
    """A static cache: per batch row a prefix of the N slots is visible (one row none at all), the mask (B, 1, 1, N)
    as Hugging Face passes it, bool and additive (-inf, and a bias); K/V past each prefix are NaN, as unused storage
    may be. Equal to the reference over the clean cache for 1, 3 and 5 splits (with 5 splits of 9 tiles, the prefix
    tiles fall to every split)."""
    B, Hkv, G, L, N, D = 3, 2, 4, 1, 9 * BN, 64
    q, k, v = _qkv(B, Hkv, G, L, N, D, torch.float16, dev)
    lengths = torch.tensor([BN + 5, 4 * BN, 0], device=dev)
    mask = (torch.arange(N, device=dev)[None, :] < lengths[:, None])[:, None, None, :]
    kp, vp = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        kp[b, :, n:] = float("nan")
        vp[b, :, n:] = float("nan")
    additive = torch.zeros(mask.shape, device=dev).masked_fill(~mask, float("-inf")) - 0.5 * (mask.float() - 0.3)
    for splits in (1, 3, 5):
        for fused, tiles_path in (((False, None), (True, None), (False, True)) if splits > 1 else ((False, True),)):
            for m in (mask, additive):
                out, lse = _split_kv(q, kp, vp, m, splits, fused=fused, mask_tiles=tiles_path)
                _assert_matches(out, lse, q, k, v, 3e-3, attn_mask=m)
                assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())  # no visible key: 0, -inf


def _hidden_tiles(dev):
    """Holes that hide whole tiles, different per query position (mask (1, 1, L, N)), per head ((B, Hq, 1, N)) and
    per batch row with holes inside visible tiles too ((B, 1, 1, N)): the K/V of hidden tiles and of the keys after
    each tile's last visible key are NaN (a hidden key inside a kept tile is read, as SDPA reads it), and none
    reaches the output."""
    B, Hkv, G, L, N, D = 2, 2, 3, 2, 8 * BN, 64
    q, k, v = _qkv(B, Hkv, G, L, N, D, torch.float16, dev, seed=1)
    col = torch.arange(N, device=dev)
    tile = col // BN
    per_query = torch.stack([(tile % 3 == 0), (tile == 5)])[None, None] & (col % BN < 9)
    per_head = (tile[None, None, None, :] == torch.arange(B * Hkv * G, device=dev).view(B, Hkv * G, 1, 1) % 8)
    one_row = torch.stack([(tile == 0) & (col < 12) | (tile == 2) & ((col % BN < 4) | (col % BN > 6)) | (tile == 3),
                           (tile == 1) | (tile == 6) & (col % BN != 8)])[:, None, None]
    for mask in (per_query, per_head, one_row):
        seen = mask.expand(B, Hkv * G, L, N).reshape(B, Hkv, G * L, N).any(dim=2)  # (B, Hkv, N)
        tile_end = torch.where(seen, col + 1, 0).view(B, Hkv, N // BN, BN).amax(-1, keepdim=True)
        unread = (col.view(N // BN, BN) >= tile_end).reshape(B, Hkv, N)  # hidden tiles, and tails after the last key
        kp, vp = k.clone(), v.clone()
        kp[unread] = float("nan")
        vp[unread] = float("nan")
        for splits, tiles_path in ((1, None), (4, None), (4, True)):
            out, lse = _split_kv(q, kp, vp, mask, splits, mask_tiles=tiles_path)
            _assert_matches(out, lse, q, k, v, 3e-3, attn_mask=mask)


_SHAPES = ("N", "LN", "11LN", "B11N", "B1LN", "BHLN", "BH1N", "1HLN")


def _shaped(kind: str, full: torch.Tensor) -> torch.Tensor:
    """The mask of broadcast form ``kind`` made of ``full`` (B, Hq, L, N): the entries a broadcast dim drops are
    those of index 0."""
    B, Hq, L, N = full.shape
    sizes = {"N": (N,), "LN": (L, N), "11LN": (1, 1, L, N), "B11N": (B, 1, 1, N), "B1LN": (B, 1, L, N),
             "BHLN": (B, Hq, L, N), "BH1N": (B, Hq, 1, N), "1HLN": (1, Hq, L, N)}[kind]
    four = (1,) * (4 - len(sizes)) + sizes
    m = full[tuple(slice(None) if s > 1 else slice(0, 1) for s in four)]
    return m.reshape(sizes)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3, 4]), L=st.integers(1, 3),
       tiles=st.integers(1, 6), extra=st.integers(0, BN - 1), kind=st.sampled_from(_SHAPES),
       dtype=st.sampled_from(["bool", "-inf", "finfo.min"]), density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
       splits=st.integers(1, 5), causal=st.booleans(), with_valid=st.booleans(), seed=st.integers(0, 2**16),
       tiles_path=st.sampled_from([None, True, False]))
def test_mask_shapes_and_kinds_fuzzed(kernel_device, B, Hkv, G, L, tiles, extra, kind, dtype, density, splits, causal,
                                      with_valid, seed, tiles_path):
    """Any mask that broadcasts to (B, Hq, L, N), bool or additive (-inf hides; finfo.min does not, and a row it
    hides whole gives the mean of V, as SDPA's math backend), visible with ``density`` (0: rows with no key), with a
    causal flag and a valid length too: equal to the reference, by the mask tiles (the copy engine for tiles whose
    last key is visible, the default with ``tma``; or all by pointer loads, ``mask_tiles=True``) and by contiguous
    shares (``mask_tiles=False``, the path before them)."""
    dev = kernel_device
    N = tiles * BN + extra or 1
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(B, Hkv, G, L, N, 64, torch.float32, dev, seed=seed)
    visible = torch.rand(B, Hkv * G, L, N, generator=gen) < density
    if density and density < 1:  # runs of visible keys, as real masks have (a prefix, a window)
        visible |= (torch.arange(N) < torch.randint(0, N + 1, (B, 1, L, 1), generator=gen))
    mask = _shaped(kind, visible.to(dev))
    if dtype != "bool":
        hide = float("-inf") if dtype == "-inf" else torch.finfo(torch.float32).min
        bias = torch.rand(mask.shape, generator=gen).to(dev)
        mask = torch.zeros(mask.shape, device=dev).masked_fill(~mask, hide) - bias
    valid = torch.randint(0, N + 1, (B,), generator=gen).to(dev) if with_valid else None
    out, lse = _split_kv(q, k, v, mask, splits, valid_len=valid, is_causal=causal, mask_tiles=tiles_path)
    _assert_matches(out, lse, q, k, v, 2e-5, attn_mask=mask, valid_len=valid, is_causal=causal)


def test_scan_rows_and_chunks():
    """A mask broadcast over the heads is scanned per query position (once when broadcast over them too); a
    per-head one per packed row. A split classifies all its tiles at once up to CHUNK_ELEMENTS mask elements."""
    assert scan_rows((0, 0, 0, 1), 4) == (True, 1)
    assert scan_rows((4 * 64, 0, 64, 1), 4) == (True, 4)
    assert scan_rows((64, 0, 64, 1), 1) == (True, 1)
    assert scan_rows((8 * 64, 64, 0, 1), 1) == (False, 0)
    assert chunk_tiles(32768, 16, 128) == (16, True) and chunk_tiles(32768, 4, 64) == (32, False)
    assert chunk_tiles(1, 1, 64) == (1, True)
    assert chunk_tiles(100, 3, 16) == (4, True)  # 7 tiles over 3 splits: at most 3 each, rounded up to a power of 2
    assert chunk_tiles(131136, 25, 64) == (32, False)


def test_a_bad_mask_tiles_value_names_the_valid_ones():
    q, k, v = _qkv(1, 1, 1, 1, 8, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="None, True, False or 'tma'"):
        split_kv_decode(q, k, v, torch.empty_like(q), attn_mask=torch.ones(8, dtype=torch.bool), mask_tiles="yes")
