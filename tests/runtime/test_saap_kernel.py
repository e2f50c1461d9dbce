"""The SAAP Triton kernel against the reference over exactly the same sparse set (interpreter on the CPU)."""
import pytest
import torch

pytest.importorskip("triton")

from attnopt.runtime.kernels import triton_usable  # noqa: E402
from attnopt.runtime.saap import attended_keys, build_clusters, saap_decode_states  # noqa: E402
from attnopt.runtime.saap.build import clusters_from_assignment  # noqa: E402
from attnopt.runtime.saap.decode import threshold_clusters  # noqa: E402
from attnopt.runtime.saap.index import LayerIndex, ModelIdentity, SaapIndex  # noqa: E402
from attnopt.runtime.saap.rope import RopeSpec  # noqa: E402

pytestmark = pytest.mark.skipif(not (triton_usable("cuda") or triton_usable("cpu")), reason="Triton cannot run here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_index(hkv: int, hq: int, d: int, clusters: int) -> SaapIndex:
    ident = ModelIdentity("test", "0", 2, hq, hkv, d)
    return SaapIndex(ident, RopeSpec(10000.0, d), {1: LayerIndex(torch.randn(hkv, clusters, d))})


def run_case(B, Hq, Hkv, N, D, L, C, probes, sink, window, prompt, dtype, splits, block_n, valid=None, scores=None,
             assign=None, window_splits=None, fused=False, window_stream=False, late=False, share_splits=False):
    """Kernel against the reference over the same sparse set. ``assign`` (B, Hkv, n): given clusters of keys
    [sink, sink + n) (default: the nearest centroid of a random index, over the first ``prompt`` keys). With
    ``valid``, the cache holds garbage (NaN) from there on."""
    from attnopt.runtime.kernels.saap import saap_decode_kernel, saap_workspace

    torch.manual_seed(N + C + probes)
    index = random_index(Hkv, Hq, D, C)
    q = torch.randn(B, Hq, L, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    n_keys = N if valid is None else valid
    if assign is None:
        state = build_clusters(index, 1, k[:, :, :n_keys], prompt, sink, window)
    else:
        state = clusters_from_assignment(assign, C, sink, window)
    k[:, :, n_keys:] = float("nan")
    v[:, :, n_keys:] = float("nan")
    if scores is None:
        scores = torch.rand(B, Hkv, C)  # distinct almost surely: the top-l is unambiguous
    chosen = threshold_clusters(scores, probes)
    keep = attended_keys(state, chosen, n_keys, L)  # (B, Hkv, L, valid length)
    vl = None if valid is None else torch.full((B,), valid, dtype=torch.int32)
    want_o, want_lse = saap_decode_states(q, k[:, :, :n_keys], v[:, :, :n_keys], keep, 0.125)
    dev = DEVICE
    out = torch.empty(B, Hq, L, D, dtype=dtype, device=dev)
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=dev)
    stats = torch.zeros(2, dtype=torch.float64, device=dev)
    ws = saap_workspace(splits, q.to(dev), v.to(dev), Hkv, C, window_stream=window_stream)
    saap_decode_kernel(q.to(dev), k.to(dev), v.to(dev), state.offsets.to(dev), state.perm.to(dev),
                       state.ends.to(dev), out, lse, scores=scores.to(dev), probes=probes, sink=sink, scale=0.125,
                       valid_len=None if vl is None else vl.to(dev), stats=stats, workspace=ws, block_n=block_n,
                       window_splits=window_splits, fused_select=fused, fused_merge=fused,
                       window_stream=window_stream, window_after_scoring=late, share_splits=share_splits)
    assert int(ws.counters.abs().sum()) == 0, "the fused merge left an arrival counter non-zero"
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.cpu().float(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=tol, rtol=tol)
    sizes = state.offsets[..., 1:] - state.offsets[..., :-1]
    attended = ((sizes * chosen).sum(-1) + sink + max(n_keys - state.indexed_end, 0)) / n_keys
    torch.testing.assert_close(stats.cpu(), torch.tensor([float(attended.mean()), 1.0], dtype=torch.float64))
    return keep


@pytest.mark.parametrize("B,Hq,Hkv,N,D,L,C,probes,splits,block_n,dtype", [
    (1, 3, 1, 150, 64, 1, 16, 3, 4, 16, torch.float32),  # G = 3
    (2, 4, 2, 97, 80, 1, 8, 2, 3, 16, torch.float16),  # odd N, D = 80 (padded)
    (1, 8, 2, 200, 64, 2, 32, 5, 5, 32, torch.float32),  # two query tokens, G = 4
    (1, 2, 2, 130, 64, 1, 16, 16, 2, 16, torch.float32),  # every cluster: dense
    (1, 2, 1, 260, 64, 1, 64, 40, 4, 32, torch.float32),  # many probes over many (small, some empty) clusters
])
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_matches_reference_on_the_same_sparse_set(B, Hq, Hkv, N, D, L, C, probes, splits, block_n, dtype, fused):
    keep = run_case(B, Hq, Hkv, N, D, L, C, probes, sink=2, window=17, prompt=N - 3, dtype=dtype, splits=splits,
                    block_n=block_n, fused=fused)
    if probes == C:
        assert bool(keep.all())
    else:
        assert float(keep.float().mean()) < 0.9  # really sparse


@pytest.mark.parametrize("splits,block_r,group,groups", [(16, 4, 4, 4), (24, 16, 4, 6), (7, 4, 4, 2)])
def test_fused_merge_in_two_levels_of_arrival(splits, block_r, group, groups):
    # the last split of each group merges its group into the group's first slot, the last group the tile: even
    # groups, a second level wider than one load (6 groups of 4: two steps), an uneven last group (7 = 4 + 3)
    from attnopt.runtime.kernels.saap_merge import merge_group_size

    assert merge_group_size(splits, block_r, 64) == group and -(-splits // group) == groups
    hq, L = (16, 2) if block_r == 16 else (8, 1)
    run_case(1, hq, 2, 300, 64, L, 16, 5, sink=1, window=20, prompt=297, dtype=torch.float32, splits=splits,
             block_n=16, fused=True)


def test_kernel_balances_a_large_cluster_over_many_splits():
    # one giant chosen cluster: 16 splits of 16-key tiles must share it and still give the exact answer
    run_case(1, 2, 1, 180, 64, 1, 4, 1, sink=1, window=8, prompt=180, dtype=torch.float32, splits=16, block_n=16)


@pytest.mark.parametrize("splits,window_splits", [(1, 0), (4, 0), (4, 1), (4, 3), (2, 1)])
def test_any_division_of_the_splits_between_window_and_clusters(splits, window_splits):
    # W = 0: split 0 takes the sink and window besides its cluster share; W = S - 1: one split for the clusters
    run_case(2, 4, 2, 170, 64, 2, 12, 4, sink=3, window=40, prompt=170, dtype=torch.float32, splits=splits,
             block_n=16, window_splits=window_splits)


@pytest.mark.parametrize("splits,block_n,window,fused", [(4, 16, 19, False), (5, 16, 19, True), (3, 32, 19, False),
                                                         (1, 16, 19, True), (3, 16, 60, False)])
def test_every_split_shares_the_window_and_the_clusters(splits, block_n, window, fused):
    # SHARE_SPLITS: each split folds its share of the sink and window (ceil(tiles / S) tiles from split 0 on: the
    # last splits may get none, and at window 60 the last of 3 splits none of 4 tiles), then its share of the chosen
    # clusters
    run_case(1, 4, 2, 220, 64, 1, 16, 5, sink=2, window=window, prompt=200, dtype=torch.float32, splits=splits,
             block_n=block_n, fused=fused, share_splits=True)


def test_shared_splits_hide_cluster_keys_past_a_valid_length():
    # as test_valid_length_below_the_indexed_end_hides_cluster_keys_past_it, with every split sharing both parts
    assign = torch.arange(150).remainder(6).view(1, 1, 150).expand(2, 2, -1).contiguous()
    run_case(2, 4, 2, 180, 64, 1, 6, 2, sink=2, window=0, prompt=0, dtype=torch.float32, splits=4, block_n=16,
             valid=90, assign=assign, share_splits=True)


def test_shared_splits_refuse_a_window_stream():
    from attnopt.runtime.kernels.saap import saap_decode_kernel

    q, kv = torch.zeros(1, 2, 1, 16), torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="share_splits and window_stream"):
        saap_decode_kernel(q, kv, kv, torch.zeros(1, 1, 3, dtype=torch.int32), torch.zeros(1, 1, 4, dtype=torch.int32),
                           torch.full((1,), 4, dtype=torch.int32), torch.empty(1, 2, 1, 16),
                           scores=torch.rand(1, 1, 2), probes=1, sink=1, num_splits=4, share_splits=True,
                           window_stream=True)


@pytest.mark.parametrize("splits,window_splits,fused,valid,late", [
    (4, 1, False, None, False), (5, 2, True, None, False), (4, 0, False, None, False), (3, 1, False, 140, False),
    (4, 2, False, None, True), (5, 3, True, 140, True)])
def test_window_splits_in_a_launch_of_their_own(splits, window_splits, fused, valid, late):
    # window_stream: the window splits launched apart (first, or after the scoring when late; here on the one
    # stream of the interpreter), the cluster splits after the selection from split W on; W = 0 falls back to one
    # launch; the fused merge's arrival counter spans both launches
    run_case(1, 4, 2, 160, 64, 1, 8, 3, sink=2, window=30, prompt=120 if valid else 150, dtype=torch.float32,
             splits=splits, block_n=16, window_splits=window_splits, fused=fused, window_stream=True, valid=valid,
             late=late)


def test_window_split_count_and_bad_counts():
    from attnopt.runtime.kernels.saap import saap_decode_kernel, window_split_count

    assert window_split_count(1, 100, 100) == 0 and window_split_count(8, 0, 100) == 0
    assert window_split_count(8, 1, 1000) == 1 and window_split_count(8, 1000, 1) == 7
    assert window_split_count(51, 1639, 4867) == 13
    q = torch.randn(1, 2, 1, 64)
    k = torch.randn(1, 1, 40, 64)
    offsets = torch.zeros(1, 1, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"window_splits must be in \[0, 4\)"):
        saap_decode_kernel(q, k, k, offsets, torch.zeros(1, 1, 0, dtype=torch.int32),
                           torch.zeros(1, dtype=torch.int32), torch.empty(1, 2, 1, 64), scores=torch.rand(1, 1, 4),
                           probes=1, sink=1, num_splits=4, window_splits=4)


@pytest.mark.parametrize("fused", [False, True])
def test_kernel_reads_nothing_past_the_valid_length(fused):
    run_case(1, 3, 1, 160, 64, 1, 8, 2, sink=1, window=10, prompt=120, dtype=torch.float32, splits=3, block_n=16,
             valid=140, fused=fused)


def test_valid_length_below_the_indexed_end_hides_cluster_keys_past_it():
    # the cache shrank under its index: clusters hold keys at and past the valid length (NaN there), never read
    assign = torch.arange(150).remainder(6).view(1, 1, 150).expand(2, 2, -1).contiguous()
    run_case(2, 4, 2, 180, 64, 1, 6, 2, sink=2, window=0, prompt=0, dtype=torch.float32, splits=4, block_n=16,
             valid=90, assign=assign)


def test_ties_break_by_the_lowest_cluster_index_with_empty_and_single_key_clusters():
    # clusters 0-3 empty, 4-7 one key each, 8 huge; scores tie in threes, so the last probe breaks a tie
    C = 12
    sizes = [0, 0, 0, 0, 1, 1, 1, 1, 90, 5, 7, 3]
    assign = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    assign = assign[torch.randperm(len(assign), generator=torch.Generator().manual_seed(1))]
    assign = assign.view(1, 1, -1).expand(1, 2, -1).contiguous()
    scores = torch.tensor([3.0, 3.0, 3.0, 1.0, 2.0, 2.0, 2.0, 0.5, 1.0, 1.0, 0.0, -1.0]).expand(1, 2, C)
    scores = scores.contiguous()
    scores[0, 1] = scores[0, 1].flip(0)
    keep = run_case(1, 6, 2, 130, 64, 1, C, 4, sink=1, window=5, prompt=0, dtype=torch.float32, splits=5,
                    block_n=16, scores=scores, assign=assign)
    chosen = threshold_clusters(scores, 4)
    # 4 probes: the three at 3.0 (empty ones), then the first of the three tied at 2.0 (a single key)
    assert chosen[0, 0].tolist() == [True, True, True, False, True] + [False] * 7
    assert chosen[0, 1].tolist() == [False] * 5 + [True] + [False] * 3 + [True] * 3  # the flip
    assert bool(keep.any(-1).all())


def test_fp16_many_query_tokens_and_heads_with_negative_scores():
    scores = -torch.rand(2, 2, 20) * 5  # negative scores order as floats do
    run_case(2, 6, 2, 300, 64, 4, 20, 7, sink=3, window=30, prompt=300, dtype=torch.float16, splits=6, block_n=32,
             scores=scores)


@pytest.mark.parametrize("fused", [False, True])
def test_kernel_with_more_splits_than_tiles_gives_empty_partials_not_nan(fused):
    run_case(1, 2, 1, 40, 64, 1, 4, 1, sink=1, window=4, prompt=40, dtype=torch.float32, splits=8, block_n=32,
             fused=fused)


@pytest.mark.cuda
@pytest.mark.parametrize("N,C,probes", [(4096, 64, 5), (70000, 1024, 200)])
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_bf16_compiled_on_the_gpu(N, C, probes, fused):
    """Compiled on a GPU (bf16 is wrong in the interpreter): long sequences, many clusters and probes."""
    keep = run_case(1, 32, 8, N, 128, 1, C, probes, sink=1, window=512, prompt=N - 1, dtype=torch.bfloat16,
                    splits=16, block_n=64, fused=fused)
    assert float(keep.float().mean()) < 0.9


def mlp_index(hkv, hq, d, clusters, hidden, rotated=False):
    index = random_index(hkv, hq, d, clusters)
    index.rotated = rotated
    g = torch.Generator().manual_seed(5)
    index.layers[1].mlp = {"w1": torch.randn(hkv, hidden, d, generator=g) / d ** 0.5,
                           "b1": torch.randn(hkv, hidden, generator=g),
                           "bn_mean": torch.randn(hkv, hidden, generator=g),
                           "bn_var": torch.rand(hkv, hidden, generator=g) + 0.5,
                           "bn_weight": torch.randn(hkv, hidden, generator=g),
                           "bn_bias": torch.randn(hkv, hidden, generator=g),
                           "w2": torch.randn(hkv, clusters, hidden, generator=g) / hidden ** 0.5,
                           "b2": torch.randn(hkv, clusters, generator=g)}
    return index


@pytest.mark.parametrize("mlp,rotated,L,valid,fused", [
    (False, False, 1, None, False), (False, True, 2, 700, False), (True, False, 1, 640, False),
    (True, False, 3, None, False), (False, True, 2, 700, True), (True, False, 3, None, True)])
def test_device_scoring_and_selection_match_the_index_scores(mlp, rotated, L, valid, fused):
    """The whole launch (de-roping, centroid or MLP logits, group softmax sums, top-l, attention) against the
    reference fed the PyTorch scores: the same clusters are picked, the same output comes out."""
    from attnopt.runtime.kernels.saap import saap_decode_kernel, saap_workspace
    from attnopt.runtime.saap.decode import kernel_scorer

    B, Hq, Hkv, D, C, N, probes, sink, window = 2, 6, 2, 64, 40, 720, 6, 2, 40
    torch.manual_seed(11)
    index = mlp_index(Hkv, Hq, D, C, 48, rotated) if mlp else random_index(Hkv, Hq, D, C)
    index.rotated = rotated
    q = torch.randn(B, Hq, L, D) * 3
    k = torch.randn(B, Hkv, N, D)
    v = torch.randn(B, Hkv, N, D)
    n_keys = N if valid is None else valid
    state = build_clusters(index, 1, k[:, :, :n_keys], n_keys, sink, window)
    pos = torch.arange(n_keys - L, n_keys)
    scores = index.cluster_scores(1, q, pos, 0.125).sum(dim=2)  # (B, Hkv, C)
    top = scores.sort(dim=-1, descending=True).values
    assert bool(((top[..., probes - 1] - top[..., probes]) > 1e-4 * top[..., 0]).all())  # no near-tie to flip
    chosen = threshold_clusters(scores, probes)
    want_o, want_lse = saap_decode_states(q, k[:, :, :n_keys], v[:, :, :n_keys],
                                          attended_keys(state, chosen, n_keys, L), 0.125)
    dev = DEVICE
    scorer = kernel_scorer(index.to(dev), 1)
    vl = None if valid is None else torch.full((B,), valid, dtype=torch.int64, device=dev)
    out = torch.empty(B, Hq, L, D, device=dev)
    lse = torch.empty(B, Hq, L, device=dev)
    ws = saap_workspace(3, q.to(dev), v.to(dev), Hkv, C, scorer.hidden)
    saap_decode_kernel(q.to(dev), k.to(dev), v.to(dev), state.offsets.to(dev), state.perm.to(dev),
                       state.ends.to(dev), out, lse, probes=probes, sink=sink, scale=0.125, scorer=scorer,
                       valid_len=vl, workspace=ws, block_n=32, fused_select=fused, fused_merge=fused)
    sel = ws.select
    assert int(sel.counters.abs().sum()) == 0 and int(ws.counters.abs().sum()) == 0  # ready for the next launch
    logits = sel.logits.cpu()  # (B, Hkv, G * L, C)
    stats = sel.chunk_stats.cpu()
    lse_rows = stats[..., 0].amax(-1) + torch.log((stats[..., 1] * torch.exp(stats[..., 0] - stats[..., 0].amax(
        -1, keepdim=True))).sum(-1))
    torch.testing.assert_close(lse_rows, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    got = torch.exp(logits - lse_rows[..., None]).sum(2)
    torch.testing.assert_close(got, scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.cpu(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-5, rtol=2e-5)


def test_derope_is_accurate_at_half_a_million_positions():
    """The in-kernel de-roping's cosines at positions near 512k (a float64 range reduction) match PyTorch's."""
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace
    from attnopt.runtime.saap.decode import kernel_scorer
    from attnopt.runtime.kernels.saap_rule import scoring_centroids
    from attnopt.runtime.saap.rope import remove_rope

    index = random_index(1, 2, 64, 16)
    q = torch.randn(1, 2, 1, 64)
    n = 524287
    unroped = remove_rope(q, torch.tensor([n - 1]), index.rope).reshape(1, 1, 2, 64)
    cents = scoring_centroids(index.layers[1].centroids).float()  # as the rule rounds them
    want = torch.einsum("bhmd,hcd->bhmc", unroped, cents) * 0.125
    ws = select_workspace(1, 1, 2, 16, 0, DEVICE)
    offsets = torch.zeros(1, 1, 17, dtype=torch.int32, device=DEVICE)
    saap_select(q.to(DEVICE), offsets, torch.zeros(1, dtype=torch.int32, device=DEVICE), ws, probes=2, scale=0.125,
                n_keys=n, scorer=kernel_scorer(index.to(DEVICE), 1))
    torch.testing.assert_close(ws.logits.cpu(), want, atol=2e-5, rtol=2e-5)


def test_the_plans_scoring_reads_bf16_centroids_and_the_index_keeps_fp32():
    """The default (``saap_rule.CENTROID_DTYPE``, measured faster on the H100): the scorer a plan prepares holds the
    centroids in bf16, half the bytes the scoring launch reads; the index itself (and its file) stays fp32."""
    from attnopt.runtime.kernels.saap_rule import CENTROID_DTYPE
    from attnopt.runtime.saap.decode import kernel_scorer

    index = random_index(2, 4, 64, 8)
    scorer = kernel_scorer(index, 1)
    assert CENTROID_DTYPE == torch.bfloat16 and scorer.centroids.dtype == torch.bfloat16
    assert index.layers[1].centroids.dtype == torch.float32
    assert torch.equal(scorer.centroids, index.layers[1].centroids.bfloat16())


@pytest.mark.parametrize("fused,refine", [(False, 0), (True, 2)])
def test_16_bit_centroids_are_scored_as_the_rule_rounds_them(monkeypatch, fused, refine):
    """With a 16-bit ``saap_rule.CENTROID_DTYPE`` (fp16 here: the interpreter has no bf16) the scoring reads the
    centroids in it (the index's at prepare, the ones refined at prefill) and its logits are the reference's over the
    same rounded centroids, not over the fp32 ones; the same clusters, the same output."""
    import attnopt.runtime.kernels.saap_rule as rule
    from attnopt.runtime.kernels.saap import saap_decode_kernel, saap_workspace
    from attnopt.runtime.saap.decode import kernel_scorer
    from attnopt.runtime.saap.rope import remove_rope

    monkeypatch.setattr(rule, "CENTROID_DTYPE", torch.float16)
    B, Hq, Hkv, D, C, N, L, probes, sink, window = 1, 4, 2, 64, 24, 400, 1, 5, 2, 32
    torch.manual_seed(5)
    index = random_index(Hkv, Hq, D, C)
    q, k, v = torch.randn(B, Hq, L, D) * 3, torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    state = build_clusters(index, 1, k, N, sink, window, refine=refine)
    scorer = kernel_scorer(index.to(DEVICE), 1)
    assert scorer.centroids.dtype == torch.float16  # half the bytes of fp32
    cents = index.layers[1].centroids.half()
    if refine:
        assert state.centroids.dtype == torch.float16  # the buffer the scoring reads
        scorer, cents = scorer._replace(centroids=state.centroids.to(DEVICE)), state.centroids
    pos = torch.arange(N - L, N)
    scores = index.cluster_scores(1, q, pos, 0.125, state.centroids).sum(dim=2)  # the reference, the rule's rounding
    unroped = remove_rope(q, pos, index.rope).reshape(B, Hkv, Hq // Hkv * L, D)
    want_logits = torch.einsum("bhmd,hcd->bhmc", unroped, cents.float()) * 0.125
    if not refine:  # the rounding is real: the fp32 centroids' logits are further off than the kernel's error
        fp32_logits = torch.einsum("bhmd,hcd->bhmc", unroped, index.layers[1].centroids) * 0.125
        assert float((fp32_logits - want_logits).abs().max()) > 1e-4
    torch.testing.assert_close(scores, torch.softmax(want_logits, -1).reshape(B, Hkv, Hq // Hkv, L, C).sum((2, 3)),
                               atol=1e-6, rtol=1e-5)
    top = scores.sort(dim=-1, descending=True).values
    assert bool(((top[..., probes - 1] - top[..., probes]) > 1e-4 * top[..., 0]).all())  # no near-tie to flip
    want_o, want_lse = saap_decode_states(q, k, v, attended_keys(state, threshold_clusters(scores, probes), N, L),
                                          0.125)
    out, lse = torch.empty(B, Hq, L, D, device=DEVICE), torch.empty(B, Hq, L, device=DEVICE)
    ws = saap_workspace(3, q.to(DEVICE), v.to(DEVICE), Hkv, C, scorer.hidden)
    saap_decode_kernel(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), state.offsets.to(DEVICE), state.perm.to(DEVICE),
                       state.ends.to(DEVICE), out, lse, probes=probes, sink=sink, scale=0.125, scorer=scorer,
                       workspace=ws, block_n=32, fused_select=fused, fused_merge=fused)
    torch.testing.assert_close(ws.select.logits.cpu(), want_logits, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.cpu(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mlp", [False, True])
@pytest.mark.parametrize("fused,window_stream,late", [(False, False, False), (True, False, False),
                                                     (False, True, False), (True, True, False), (False, True, True)])
def test_scored_decode_replays_in_a_cuda_graph_as_the_length_grows(mlp, fused, window_stream, late):
    """bf16 on a GPU: scoring, selection, attention and merge captured once in a CUDA graph, replayed at three
    valid lengths (read on the device); each replay equals the reference over the sparse set the PyTorch scores
    pick, and the selectivity counter counts every replay. With ``window_stream`` the window's launch is a
    parallel branch of the graph (a side stream: forked first, or after the scoring when ``late``), joined before
    the merge."""
    from attnopt.runtime.kernels.saap import saap_decode_kernel, saap_workspace
    from attnopt.runtime.saap.decode import kernel_scorer

    B, Hq, Hkv, D, C, N, probes, sink, window = 1, 32, 8, 128, 512, 40000, 40, 1, 1000
    torch.manual_seed(3)
    index = (mlp_index(Hkv, Hq, D, C, 256) if mlp else random_index(Hkv, Hq, D, C)).to("cuda")
    q = torch.randn(B, Hq, 1, D, device="cuda").bfloat16()
    k = torch.randn(B, Hkv, N, D, device="cuda").bfloat16()
    v = torch.randn(B, Hkv, N, D, device="cuda").bfloat16()
    prompt = N - 3000
    state = build_clusters(index, 1, k, prompt, sink, window)
    scorer = kernel_scorer(index, 1)
    ws = saap_workspace(24, q, v, Hkv, C, scorer.hidden, window_stream)
    valid = torch.tensor([prompt], dtype=torch.int32, device="cuda")
    out = torch.empty(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    stats = torch.zeros(2, dtype=torch.float64, device="cuda")

    def call():
        saap_decode_kernel(q, k, v, state.offsets, state.perm, state.ends, out, probes=probes, sink=sink,
                           scale=D ** -0.5, scorer=scorer, valid_len=valid, stats=stats, workspace=ws, block_n=64,
                           fused_select=fused, fused_merge=fused, window_stream=window_stream,
                           window_after_scoring=late)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    stats.zero_()
    for n in (prompt, prompt + 1, N - 7):
        valid.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        scores = index.cluster_scores(1, q, torch.tensor([n - 1], device="cuda"), D ** -0.5).sum(dim=2)
        keep = attended_keys(state, threshold_clusters(scores, probes), n, 1)
        want, _ = saap_decode_states(q, k[:, :, :n], v[:, :, :n], keep, D ** -0.5)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert float(stats[1]) == 3.0 and 0.0 < float(stats[0]) / 3 < 0.5
    if window_stream:  # a workspace made without the side stream is refused, before any launch
        with pytest.raises(ValueError, match=r"saap_workspace\(\.\.\., window_stream=True\)"):
            saap_decode_kernel(q, k, v, state.offsets, state.perm, state.ends, out, probes=probes, sink=sink,
                               scorer=scorer, valid_len=valid, block_n=64, window_stream=True,
                               workspace=saap_workspace(24, q, v, Hkv, C, scorer.hidden))
    assert int(ws.counters.abs().sum()) == 0 and int(ws.select.counters.abs().sum()) == 0  # every replay resets them


@pytest.mark.parametrize("seed", range(4))
def test_work_list_is_the_threshold_rule_over_tied_and_infinite_scores(seed):
    """The selection's compact list (the chosen non-empty clusters in order, their key prefix and perm shift) is
    exactly ``threshold_clusters``' pick, with integer-valued (tie-heavy), negative and -inf scores."""
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace

    g = torch.Generator().manual_seed(seed)
    B, Hkv, C = 2, 3, 37
    scores = torch.randint(-3, 4, (B, Hkv, C), generator=g).float()
    scores[0, 0, :5] = float("-inf")
    sizes = torch.randint(0, 4, (B, Hkv, C), generator=g).int()
    offsets = torch.cat([torch.zeros(B, Hkv, 1, dtype=torch.int32), sizes.cumsum(-1).int()], dim=-1)
    probes = [1, 5, 17, C][seed]
    ws = select_workspace(B, Hkv, 1, C, 0, DEVICE)
    saap_select(torch.zeros(B, Hkv, 1, 8, device=DEVICE), offsets.to(DEVICE), torch.zeros(B, dtype=torch.int32,
                device=DEVICE), ws, probes=probes, scale=1.0, n_keys=0, scores=scores.to(DEVICE))
    picked = threshold_clusters(scores, probes) & (sizes > 0)
    for b in range(B):
        for h in range(Hkv):
            row = b * Hkv + h
            sz = sizes[b, h][picked[b, h]]
            incl = sz.cumsum(0).int()
            n = len(sz)
            assert ws.incl[row, :n].cpu().tolist() == incl.tolist()
            assert bool((ws.incl[row, n:].cpu() == 2 ** 31 - 1).all())
            shift = offsets[b, h, :-1][picked[b, h]] - (incl - sz)
            assert ws.shift[row, :n].cpu().tolist() == shift.tolist()
            assert int(ws.total[row]) == int(sz.sum())


@pytest.mark.parametrize("key_bits", [16, 32])
def test_radix_select_stopping_early_picks_the_threshold_rule_over_random_floats(key_bits):
    """The selection stops its radix rounds once the keys at or above the threshold so far are exactly the probes:
    over random floats (distinct, or sharing all but their last bits, so that some heads need every round) the
    chosen clusters are still exactly ``threshold_clusters``'; all equal (every cluster ties) and -inf to +inf as
    well; on the rule's 16-bit keys (many ties, broken by index) and on 32-bit ones."""
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace

    g = torch.Generator().manual_seed(4)
    B, Hkv, C = 1, 6, 300
    scores = torch.rand(B, Hkv, C, generator=g)
    scores[0, 4] = 0.25
    scores[0, 5, :3], scores[0, 5, 3:6] = float("inf"), float("-inf")
    near = torch.tensor(0.7).view(torch.int32) + torch.randint(0, 4, (C,), generator=g, dtype=torch.int32)
    scores[0, 1] = near.view(torch.float32)  # ties and one-ulp neighbours: the last rounds decide
    scores[0, 2] = -scores[0, 2] * 1e-30  # tiny negatives
    sizes = torch.ones(B, Hkv, C, dtype=torch.int32)
    offsets = torch.cat([torch.zeros(B, Hkv, 1, dtype=torch.int32), sizes.cumsum(-1).int()], dim=-1)
    for probes, guess in ((1, False), (7, True), (150, False), (150, True), (299, True), (300, False)):
        # guess: the first round's digit from one count where fewer than the probes score >= 2 and enough >= 0
        # (every head here but the negative one, which takes the round)
        ws = select_workspace(B, Hkv, 1, C, 0, DEVICE)
        saap_select(torch.zeros(B, Hkv, 1, 8, device=DEVICE), offsets.to(DEVICE),
                    torch.zeros(B, dtype=torch.int32, device=DEVICE), ws, probes=probes, scale=1.0, n_keys=0,
                    scores=scores.to(DEVICE), guess_top=guess, key_bits=key_bits)
        want = threshold_clusters(scores, probes, key_bits)
        for h in range(Hkv):
            n = int(want[0, h].sum())
            assert int(ws.total[h]) == n, (probes, h)
            assert ws.incl[h, :n].cpu().tolist() == list(range(1, n + 1))
            assert (ws.shift[h, :n].cpu() + torch.arange(n)).tolist() == torch.nonzero(want[0, h]).flatten().tolist()


def test_many_clusters_take_narrower_radix_rounds_and_chunked_first_entries(monkeypatch):
    """Past 2048 clusters the selection finds 2 threshold bits per round (1 past 8192): forced here on a small
    table, with the attention's first-entry search read in chunks (4 of 512 entries), the answer is the same."""
    import attnopt.runtime.kernels.saap as attn
    import attnopt.runtime.kernels.saap_select as sel

    monkeypatch.setattr(attn, "FIRST_CHUNK", 512)
    for bits in (1, 2):
        monkeypatch.setattr(sel, "radix_bits", lambda block_c, bits=bits: bits)
        test_work_list_is_the_threshold_rule_over_tied_and_infinite_scores(2)
    run_case(1, 2, 1, 1200, 64, 1, 1100, 300, sink=1, window=20, prompt=1200, dtype=torch.float32, splits=3,
             block_n=64)


def test_kv_prefetch_spans_each_rows_lines_up_to_a_power_of_two():
    from attnopt.runtime.kernels.saap import kv_prefetch_lines

    assert [kv_prefetch_lines(d, 2) for d in (64, 80, 96, 128, 256)] == [1, 2, 2, 2, 4]
    assert kv_prefetch_lines(128, 4) == 4 and kv_prefetch_lines(8, 2) == 1


def test_select_warps_outside_the_choices_are_refused():
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace

    q = torch.randn(1, 4, 1, 16)
    offsets = torch.zeros(1, 2, 9, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_warps must be 4, 8, 16 or 32"):
        saap_select(q, offsets, torch.zeros(1, dtype=torch.int32), select_workspace(1, 2, 2, 8, 0, "cpu"),
                    probes=2, scale=1.0, n_keys=10, scores=torch.rand(1, 2, 8), num_warps=12)


def test_mismatched_workspace_or_scores_are_refused_before_any_launch():
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace
    from attnopt.runtime.saap.decode import kernel_scorer

    q = torch.randn(1, 4, 1, 64)
    offsets = torch.zeros(1, 2, 9, dtype=torch.int32)
    end = torch.zeros(1, dtype=torch.int32)
    scorer = kernel_scorer(mlp_index(2, 4, 64, 8, 16), 1)
    with pytest.raises(ValueError, match="allocate it with select_workspace for this scorer"):
        saap_select(q, offsets, end, select_workspace(1, 2, 2, 8, 0, "cpu"), probes=2, scale=1.0, n_keys=10,
                    scorer=scorer)
    with pytest.raises(ValueError, match=r"scores must have shape \(B, Hkv, C\) = \(1, 2, 8\)"):
        saap_select(q, offsets, end, select_workspace(1, 2, 2, 8, 0, "cpu"), probes=2, scale=1.0, n_keys=10,
                    scores=torch.rand(1, 2, 7))


@pytest.mark.parametrize("clusters,warps", [(300, None), (1100, None), (1100, 8)])
def test_fused_scoring_and_selection_leave_the_selection_launchs_work_list(clusters, warps):
    """The fused centroid launch (its last program per head selects from every chunk's logits and statistics; at 16
    warps, the rule at 1100 clusters, chunks of BLOCK_LOGITS_Q_FUSED clusters, at 8 of 64) leaves exactly the work
    list of scoring and selection apart."""
    from attnopt.runtime.kernels.saap_select import BLOCK_LOGITS_Q_FUSED, saap_select, select_workspace
    from attnopt.runtime.saap.decode import kernel_scorer

    assert clusters > 2 * BLOCK_LOGITS_Q_FUSED  # several fused chunks arrive per head
    B, Hq, Hkv, D = 2, 6, 2, 64
    torch.manual_seed(clusters)
    scorer = kernel_scorer(random_index(Hkv, Hq, D, clusters).to(DEVICE), 1)
    q = torch.randn(B, Hq, 1, D, device=DEVICE) * 3
    sizes = torch.randint(0, 5, (B, Hkv, clusters), dtype=torch.int32)
    offsets = torch.cat([torch.zeros(B, Hkv, 1, dtype=torch.int32), sizes.cumsum(-1, dtype=torch.int32)], -1)
    end = torch.full((B,), int(offsets.max()) + 1, dtype=torch.int32, device=DEVICE)
    lists = []
    for fused in (False, True):
        ws = select_workspace(B, Hkv, Hq // Hkv, clusters, 0, DEVICE)
        saap_select(q, offsets.to(DEVICE), end, ws, probes=37, scale=0.125, n_keys=int(end[0]) + 50, sink=1,
                    scorer=scorer, fused=fused, num_warps=warps)
        assert int(ws.counters.abs().sum()) == 0
        n = ws.total.cpu()
        lists.append((ws.incl.cpu(), ws.shift.cpu(), n))
    (incl, shift, total), (incl_f, shift_f, total_f) = lists
    assert torch.equal(total, total_f) and torch.equal(incl, incl_f)
    picked = incl != 2147483647
    assert torch.equal(shift[picked], shift_f[picked]) and 0 < int(picked.sum(-1).min())


def test_scoring_and_selection_apart_and_other_radix_widths_leave_the_same_work_list():
    """The piece microbenchmark's launches (``launches="scoring"`` then ``"selection"`` over the logits it left)
    the selection at 2 and 8 bits a radix round, and the logits as "fma" products leave the plan's work list; the
    ablations (``skip``) keep the key total of every non-empty cluster; bad knobs are refused naming the choices."""
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace
    from attnopt.runtime.saap.decode import kernel_scorer

    B, Hq, Hkv, D, C = 1, 4, 2, 32, 300
    torch.manual_seed(5)
    scorer = kernel_scorer(random_index(Hkv, Hq, D, C).to(DEVICE), 1)
    q = torch.randn(B, Hq, 1, D, device=DEVICE) * 3
    sizes = torch.randint(0, 5, (B, Hkv, C), dtype=torch.int32)
    offsets = torch.cat([torch.zeros(B, Hkv, 1, dtype=torch.int32), sizes.cumsum(-1, dtype=torch.int32)], -1)
    end = torch.full((B,), int(offsets.max()) + 1, dtype=torch.int32, device=DEVICE)
    ws = select_workspace(B, Hkv, Hq // Hkv, C, 0, DEVICE)

    def select(**kw):
        saap_select(q, offsets.to(DEVICE), end, ws, probes=29, scale=0.125, n_keys=int(end[0]) + 9, sink=1,
                    scorer=scorer, **kw)
        return ws.incl.cpu().clone(), ws.total.cpu().clone()

    want = select()
    ws.incl.zero_()
    select(launches="scoring")
    assert int(ws.incl.abs().sum()) == 0  # the scoring alone chooses nothing
    for kw in ({}, {"radix": 2}, {"radix": 8}, {"num_warps": 8, "radix": 8}, {"guess_top": True}):
        got = select(launches="selection", **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), kw
    for skip in (1, 2):
        assert select(launches="selection", skip=skip)[1].tolist() == sizes.sum(-1).flatten().tolist()
    for fused in (False, True):  # the logits as fp32 products summed in registers (no tl.dot): the same pick
        got = select(precision="fma", fused=fused)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fused
    with pytest.raises(ValueError, match="launches must be all, scoring or selection, radix None, 1, 2, 4 or 8"):
        select(radix=3)


def test_scoring_precision_rule_takes_fma_for_few_centroid_rows():
    from attnopt.runtime.kernels.saap_select import FMA_MAX_ROWS, block_rows_for, scoring_precision

    assert FMA_MAX_ROWS >= 4  # llama3-8b decode: 4 query heads a KV head, one token
    assert scoring_precision(4) == scoring_precision(3) == "fma" and block_rows_for(3, "fma") == 4
    assert scoring_precision(4 * FMA_MAX_ROWS) == "tf32x3" and block_rows_for(3, "tf32x3") == 16
    assert scoring_precision(4, hidden=1024) == "tf32x3"  # the query MLP keeps the tensor cores



def test_mlp_scoring_is_the_rules_folded_bf16_mlp():
    """The query MLP as every scorer computes it (``saap_rule.scoring_mlp`` / ``mlp_logits``): the BatchNorm folded
    into the first layer, bf16 weights and inputs, fp32 sums. The rule is within bf16 rounding of the index's fp32
    eval MLP and really rounds (it is not that MLP); the kernel's logits (both launches, "bf16-ieee" here, the
    rounding done with integer ops) are the rule's to fp32 summation order, far closer than the rounding."""
    from attnopt.runtime.kernels.saap_rule import mlp_logits, scoring_mlp
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace
    from attnopt.runtime.saap.decode import kernel_scorer
    from attnopt.runtime.saap.rope import remove_rope

    B, Hq, Hkv, D, C, H, L, n = 1, 6, 2, 64, 40, 48, 2, 500
    index = mlp_index(Hkv, Hq, D, C, H)
    p, eps = index.layers[1].mlp, index.bn_eps
    torch.manual_seed(2)
    q = torch.randn(B, Hq, L, D) * 3
    x = remove_rope(q, torch.arange(n - L, n), index.rope).reshape(B, Hkv, Hq // Hkv * L, D)
    h = torch.einsum("bhmd,hkd->bhmk", x, p["w1"]) + p["b1"][None, :, None]
    h = (h - p["bn_mean"][None, :, None]) * torch.rsqrt(p["bn_var"][None, :, None] + eps)
    h = torch.relu(h * p["bn_weight"][None, :, None] + p["bn_bias"][None, :, None])
    fp32 = torch.einsum("bhmk,hck->bhmc", h, p["w2"]) + p["b2"][None, :, None]
    folded = scoring_mlp(p, eps)
    assert folded.w1.dtype == folded.w2.dtype == torch.bfloat16 and folded.b1.dtype == torch.float32
    rule = mlp_logits(folded, x)
    err = float((rule - fp32).abs().max())
    assert 1e-3 < err < 0.05 * float(fp32.abs().max())
    ws = select_workspace(B, Hkv, Hq // Hkv * L, C, H, DEVICE)
    saap_select(q.to(DEVICE), torch.zeros(B, Hkv, C + 1, dtype=torch.int32, device=DEVICE),
                torch.zeros(B, dtype=torch.int32, device=DEVICE), ws, probes=3, scale=0.125, n_keys=n,
                scorer=kernel_scorer(index.to(DEVICE), 1), launches="scoring")
    torch.testing.assert_close(ws.logits.cpu(), rule, atol=2e-5, rtol=2e-5)
    assert float((ws.logits.cpu() - rule).abs().max()) < err / 20
