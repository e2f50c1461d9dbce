"""The SAAP Triton kernel against the reference over exactly the same sparse set (interpreter on the CPU)."""
import pytest
import torch

pytest.importorskip("triton")

from attnopt.runtime.kernels import triton_usable  # noqa: E402
from attnopt.runtime.saap import attended_keys, build_clusters, saap_decode_states  # noqa: E402
from attnopt.runtime.saap.index import LayerIndex, ModelIdentity, SaapIndex  # noqa: E402
from attnopt.runtime.saap.rope import RopeSpec  # noqa: E402

pytestmark = pytest.mark.skipif(not (triton_usable("cuda") or triton_usable("cpu")), reason="Triton cannot run here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_index(hkv: int, hq: int, d: int, clusters: int) -> SaapIndex:
    ident = ModelIdentity("test", "0", 2, hq, hkv, d)
    return SaapIndex(ident, RopeSpec(10000.0, d), {1: LayerIndex(torch.randn(hkv, clusters, d))})


def run_case(B, Hq, Hkv, N, D, L, C, probes, sink, window, prompt, dtype, splits, block_n, valid=None):
    from attnopt.runtime.kernels.saap import saap_decode_kernel

    torch.manual_seed(N + C + probes)
    index = random_index(Hkv, Hq, D, C)
    q = torch.randn(B, Hq, L, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    n_keys = N if valid is None else valid
    state = build_clusters(index, 1, k[:, :, :n_keys], prompt, sink, window)
    scores = torch.rand(B, Hkv, C)  # distinct almost surely: the top-l is unambiguous
    clusters = scores.topk(probes, dim=-1).indices
    keep = attended_keys(state, clusters, n_keys, L)
    want_o, want_lse = saap_decode_states(q[..., :], k[:, :, :n_keys], v[:, :, :n_keys], keep, 0.125)
    dev = DEVICE
    out = torch.empty(B, Hq, L, D, dtype=dtype, device=dev)
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=dev)
    end = torch.full((B,), state.indexed_end, dtype=torch.int32, device=dev)
    vl = None if valid is None else torch.full((B,), valid, dtype=torch.int32, device=dev)
    saap_decode_kernel(q.to(dev), k.to(dev), v.to(dev), scores.to(dev), state.offsets.to(dev), state.perm.to(dev),
                       end, out, lse, probes=probes, sink=sink, scale=0.125, valid_len=vl, num_splits=splits,
                       block_n=block_n)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.cpu().float(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=tol, rtol=tol)
    return keep


@pytest.mark.parametrize("B,Hq,Hkv,N,D,L,C,probes,splits,block_n,dtype", [
    (1, 3, 1, 150, 64, 1, 16, 3, 4, 16, torch.float32),  # G = 3
    (2, 4, 2, 97, 80, 1, 8, 2, 3, 16, torch.float16),  # odd N, D = 80 (padded)
    (1, 8, 2, 200, 64, 2, 32, 5, 5, 32, torch.float32),  # two query tokens, G = 4
    (1, 2, 2, 130, 64, 1, 16, 16, 2, 16, torch.float32),  # every cluster: dense
    (1, 2, 1, 260, 64, 1, 64, 40, 4, 32, torch.float32),  # many probes over many (small, some empty) clusters
])
def test_kernel_matches_reference_on_the_same_sparse_set(B, Hq, Hkv, N, D, L, C, probes, splits, block_n, dtype):
    keep = run_case(B, Hq, Hkv, N, D, L, C, probes, sink=2, window=17, prompt=N - 3, dtype=dtype, splits=splits,
                    block_n=block_n)
    if probes == C:
        assert bool(keep.all())
    else:
        assert float(keep.float().mean()) < 0.9  # really sparse


def test_kernel_balances_a_large_cluster_over_many_splits():
    # one giant chosen cluster: 16 splits of 16-key tiles must share it and still give the exact answer
    run_case(1, 2, 1, 180, 64, 1, 4, 1, sink=1, window=8, prompt=180, dtype=torch.float32, splits=16, block_n=16)


def test_kernel_reads_nothing_past_the_valid_length():
    run_case(1, 3, 1, 160, 64, 1, 8, 2, sink=1, window=10, prompt=120, dtype=torch.float32, splits=3, block_n=16,
             valid=140)


def test_kernel_with_more_splits_than_tiles_gives_empty_partials_not_nan():
    run_case(1, 2, 1, 40, 64, 1, 4, 1, sink=1, window=4, prompt=40, dtype=torch.float32, splits=8, block_n=32)


@pytest.mark.cuda
@pytest.mark.parametrize("N,C,probes", [(4096, 64, 5), (70000, 1024, 200)])
def test_kernel_bf16_compiled_on_the_gpu(N, C, probes):
    """Compiled on a GPU (bf16 is wrong in the interpreter): long sequences, many clusters and probes."""
    keep = run_case(1, 32, 8, N, 128, 1, C, probes, sink=1, window=512, prompt=N - 1, dtype=torch.bfloat16,
                    splits=16, block_n=64)
    assert float(keep.float().mean()) < 0.9
