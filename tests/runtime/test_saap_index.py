"""SAAP index: de-roping, collection, training, the artifact's validation, the build at prefill and the
reference sparse decode, on a tiny random Llama (CPU, seconds)."""
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("faiss")
pytest.importorskip("safetensors")

from attnopt.runtime.kernels.saap_rule import scoring_centroids  # noqa: E402
from attnopt.runtime.reference import attention_states  # noqa: E402
from attnopt.runtime.saap import (ClusterState, SaapIndexError, apply_rope, attended_keys, build_clusters,  # noqa: E402
                                  load_index, remove_rope, rope_spec_from_config, saap_decode, select_clusters)
from attnopt.runtime.saap.collect import collect  # noqa: E402
from attnopt.runtime.saap.train import cluster_count, long_range_targets, train_index  # noqa: E402


def tiny_config(**over):
    cfg = dict(hidden_size=96, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=3, vocab_size=97, max_position_embeddings=2048, rope_theta=10000.0)
    cfg.update(over)
    return transformers.LlamaConfig(**cfg)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).eval()
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(scope="module")
def trained(tiny_model):
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (384,), generator=gen) for _ in range(2)]
    coll = collect(tiny_model, seqs, queries_per_sequence=96, min_query_position=96)
    index = train_index(coll, clusters=16, hidden=32, steps=30, batch=64, window=16, kmeans_iterations=5)
    return coll, index


def test_rope_spec_reads_transformers5_parameters_and_refuses_scaled_rope():
    spec = rope_spec_from_config(tiny_config(rope_theta=12345.0))
    assert spec.theta == 12345.0 and spec.rotary_dim == 16
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        rope_spec_from_config(tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 512}))


def test_remove_rope_inverts_hf_llama_rotation():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = tiny_config()
    spec = rope_spec_from_config(cfg)
    rot = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, 2, 37, 16)
    pos = torch.arange(100, 137)[None]
    cos, sin = rot(x, pos)
    xr, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(apply_rope(x, pos[0], spec), xr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(remove_rope(xr, pos[0], spec), x, atol=1e-5, rtol=1e-5)


def test_collect_records_the_unrotated_projections(tiny_model):
    seen = {}
    attn = tiny_model.model.layers[1].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, i, o: seen.setdefault("k", o.detach()))
    try:
        ids = torch.randint(0, 97, (200,))
        coll = collect(tiny_model, [ids], queries_per_sequence=8, min_query_position=100)
    finally:
        hook.remove()
    k = seen["k"].view(200, 2, 16).transpose(0, 1)  # (Hkv, N, D) before RoPE
    torch.testing.assert_close(coll.sequences[0].keys[1], k, atol=1e-4, rtol=1e-4)
    pos = coll.sequences[0].query_positions
    assert pos.min() >= 100 and coll.sequences[0].queries[1].shape == (6, 8, 16)


def test_collection_round_trip_and_corrupt_files_name_the_file(tmp_path, trained):
    from safetensors.torch import load_file, save_file

    from attnopt.runtime.saap.collect import Collection

    coll, _ = trained
    path = tmp_path / "c.safetensors"
    coll.save(path)
    back = Collection.load(path)
    assert back.identity == coll.identity and len(back.sequences) == len(coll.sequences)
    torch.testing.assert_close(back.sequences[1].keys[2], coll.sequences[1].keys[2], atol=0, rtol=0)

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match="junk.safetensors is not a readable safetensors file"):
        Collection.load(junk)
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="cut.safetensors"):
        Collection.load(truncated)

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "seq1.layer2.queries"}, str(missing), metadata=meta)
    with pytest.raises(ValueError, match="missing.safetensors lacks tensor.*seq1.layer2.queries"):
        Collection.load(missing)
    bad_meta = tmp_path / "meta.safetensors"
    save_file(tensors, str(bad_meta), metadata={"saap_collection": "{oops"})
    with pytest.raises(ValueError, match="meta.safetensors: corrupt metadata"):
        Collection.load(bad_meta)
    no_keys = tmp_path / "nokeys.safetensors"
    partial = {k: v for k, v in json.loads(meta["saap_collection"]).items() if k != "rope"}
    save_file(tensors, str(no_keys), metadata={"saap_collection": json.dumps(partial)})
    with pytest.raises(ValueError, match="nokeys.safetensors: metadata lacks rope"):
        Collection.load(no_keys)


def test_long_range_targets_are_the_attention_mass_per_cluster():
    torch.manual_seed(0)
    q, k = torch.randn(5, 8), torch.randn(40, 8)
    pos = torch.tensor([10, 20, 30, 39, 3])
    assign = torch.randint(0, 4, (39,))
    t, has = long_range_targets(q, pos, k, assign, 4, sink=1, window=4, scale=0.5)
    assert has.tolist() == [True, True, True, True, False]
    for r in range(4):
        js = torch.arange(1, int(pos[r]) - 4)
        p = torch.softmax((k[js] @ q[r]) * 0.5, 0)
        want = torch.zeros(4).index_add_(0, assign[js - 1], p)
        torch.testing.assert_close(t[r], want)
    assert float(t[4].sum()) == 0.0


def test_cluster_count_scales_with_the_context():
    assert cluster_count(8192) == 2048 and cluster_count(2048) == 512 and cluster_count(40) == 16
    assert cluster_count(131072) == 2048  # the selection kernel's limit
    assert cluster_count(8192, keys_per_cluster=64) == 128
    from attnopt.runtime.saap.train import decode_defaults

    assert decode_defaults(2048, 8192) == {"probes": 143, "sink": 4, "window": 64}


def _inertia(cents, keys):
    """Sum of squared distances of keys (B, H, n, D) to their nearest centroid (H, C, D)."""
    return float(torch.cdist(keys.transpose(0, 1).reshape(keys.shape[1], -1, keys.shape[-1]), cents).amin(-1)
                 .pow(2).sum())


def test_refinement_moves_the_centroids_onto_the_prompt_and_decode_scores_with_them(tmp_path, trained):
    import dataclasses

    index = trained[1].without_mlp()  # centroid scoring: what refinement changes
    torch.manual_seed(3)
    B, N = 2, 260
    k = torch.randn(B, 2, N, 16) * 2 + 1  # keys unlike the training ones: refinement has work to do
    plain = build_clusters(index, 1, k, prompt_len=N - 3, sink=1, window=20)
    assert plain.centroids is None
    refined_index = dataclasses.replace(index, refine=3)
    st = build_clusters(refined_index, 1, k, prompt_len=N - 3, sink=1, window=20)
    def rounded(t):  # as the rule rounds the centroids that decode scores with (saap_rule.scoring_centroids)
        return scoring_centroids(t).float()

    assert st.centroids.shape == index.layers[1].centroids.shape
    assert st.centroids.dtype == scoring_centroids(index.layers[1].centroids).dtype
    indexed = remove_rope(k[:, :, 1:N - 23], torch.arange(1, N - 23), index.rope)
    # Lloyd passes pooled over the batch rows never increase the inertia
    assert _inertia(st.centroids.float(), indexed) < _inertia(index.layers[1].centroids, indexed)
    for h in range(2):  # each centroid is the mean of its cluster's keys over both rows; an empty one, of all keys
        for c in range(16):
            members = indexed[:, h][st.assign[:, h] == c]
            want = members.mean(0) if len(members) else indexed[:, h].reshape(-1, 16).mean(0)
            torch.testing.assert_close(st.centroids[h, c].float(), rounded(want), atol=1e-5, rtol=1e-5)
    one = build_clusters(index, 1, k, prompt_len=N - 3, sink=1, window=20, refine=1)  # one pass: the plain assignment
    torch.testing.assert_close(one.assign, plain.assign)
    assert int(st.offsets[..., -1].min()) == N - 24
    q, v = torch.randn(B, 6, 1, 16), torch.randn(B, 2, N, 16)
    o, _, _ = saap_decode(refined_index, 1, st, q, k, v, 3, 0.25)
    clusters = select_clusters(index, 1, q, torch.tensor([N - 1]), 3, 0.25, centroids=st.centroids)
    want, _ = attention_states(q, k, v, attn_mask=_brute_keep(st, clusters, N).repeat_interleave(3, 1)[:, :, None],
                               scale=0.25)
    torch.testing.assert_close(o, want)
    assert not torch.equal(clusters, select_clusters(index, 1, q, torch.tensor([N - 1]), 3, 0.25))
    few = build_clusters(refined_index, 1, k, prompt_len=29, sink=1, window=20)  # 8 keys a row for 16 clusters
    sizes = (few.offsets[..., 1:] - few.offsets[..., :-1]).sum(0)  # (Hkv, C) over both rows
    mean_key = remove_rope(k[:, :, 1:9], torch.arange(1, 9), index.rope).transpose(0, 1).reshape(2, -1, 16).mean(1)
    assert (sizes == 0).any()
    one_pass = build_clusters(refined_index, 1, k, prompt_len=29, sink=1, window=20, refine=1)
    one_sizes = (one_pass.offsets[..., 1:] - one_pass.offsets[..., :-1]).sum(0)
    assert (sizes > 0).sum() > (one_sizes > 0).sum()  # empty clusters re-seeded on outliers between passes
    torch.testing.assert_close(few.centroids[sizes == 0].float(),
                               rounded(mean_key[:, None].expand(-1, 16, -1)[sizes == 0]))
    empty = build_clusters(refined_index, 1, k, prompt_len=10, sink=1, window=20)  # nothing indexed: a copy
    torch.testing.assert_close(empty.centroids.float(), rounded(index.layers[1].centroids))
    with pytest.raises(ValueError, match="refine"):
        build_clusters(index, 1, k, prompt_len=N, sink=1, window=20, refine=-1)
    refined_index.without_mlp().save(tmp_path / "r.safetensors")
    assert load_index(tmp_path / "r.safetensors").refine == 3 and load_index_meta_refine(index, tmp_path) == 0


def load_index_meta_refine(index, tmp_path):
    """The refine of an index saved as before the option (no 'refine' in its metadata): 0."""
    from safetensors.torch import load_file, save_file

    index.save(tmp_path / "old.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "old.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["saap"])
    del meta["refine"]
    save_file(load_file(str(tmp_path / "old.safetensors")), str(tmp_path / "old.safetensors"),
              metadata={"saap": json.dumps(meta)})
    return load_index(tmp_path / "old.safetensors").refine


def test_index_round_trip_and_scores(tmp_path, trained):
    _, index = trained
    path = tmp_path / "i.safetensors"
    index.save(path)
    back = load_index(path, tiny_config())
    assert sorted(back.layers) == [1, 2] and back.has_mlp and back.num_clusters == 16
    for l in (1, 2):
        torch.testing.assert_close(back.layers[l].centroids, index.layers[l].centroids)
    q = torch.randn(1, 6, 2, 16)
    s = back.cluster_scores(1, q, torch.tensor([300, 301]), 0.25)
    assert s.shape == (1, 2, 2, 16)
    torch.testing.assert_close(s.sum(-1), torch.full((1, 2, 2), 3.0))  # G = 3 distributions summed
    base = back.without_mlp().cluster_scores(1, q, torch.tensor([300, 301]), 0.25)
    assert not torch.allclose(s, base)


def test_rotated_index_clusters_and_scores_the_vectors_as_the_cache_holds_them(tmp_path, trained):
    coll, _ = trained
    index = train_index(coll, clusters=16, hidden=16, steps=5, batch=32, window=16, kmeans_iterations=3,
                        rotated=True)
    path = tmp_path / "rot.safetensors"
    index.save(path)
    back = load_index(path, tiny_config())
    assert back.rotated and back.without_mlp().rotated and back.to("cpu").rotated
    # the centroids live among the rotated keys: the recorded (de-roped) keys, rotated back, sit nearer to them
    rec = coll.sequences[0]
    rotated = apply_rope(rec.keys[1], torch.arange(rec.length), back.rope)[:, 1:]
    cents = back.layers[1].centroids
    assert torch.cdist(rotated, cents).min(-1).values.mean() < torch.cdist(rec.keys[1][:, 1:], cents).min(-1).values.mean()
    k = torch.randn(1, 2, 120, 16)
    st = build_clusters(back, 1, k, prompt_len=100, sink=1, window=10)
    from attnopt.runtime.saap.build import assign_keys

    assert torch.equal(st.assign, assign_keys(cents, k[:, :, 1:90]))  # no de-roping
    q = torch.randn(1, 6, 1, 16)
    got = back.without_mlp().cluster_scores(1, q, torch.tensor([119]), 0.25)
    want = torch.softmax(torch.einsum("bhld,hcd->bhlc", q.reshape(1, 2, 3, 16), scoring_centroids(cents).float())
                         * 0.25, -1).sum(2)  # the centroids as the rule rounds them
    torch.testing.assert_close(got[:, :, 0], want)


def test_mismatched_or_corrupt_index_names_the_file_and_the_mismatch(tmp_path, trained):
    _, index = trained
    path = tmp_path / "idx.safetensors"
    index.save(path)
    with pytest.raises(SaapIndexError, match=r"idx\.safetensors.*num_layers is 3 in the index .* but 4"):
        load_index(path, tiny_config(num_hidden_layers=4))
    with pytest.raises(SaapIndexError, match=r"idx\.safetensors.*config_hash"):
        load_index(path, tiny_config(intermediate_size=128))
    with pytest.raises(SaapIndexError, match=r"idx\.safetensors has RoPE .*'theta': 10000.0.* but the model has .*5000"):
        load_index(path, tiny_config(rope_theta=5000.0))
    with pytest.raises(SaapIndexError, match=r"idx\.safetensors.*rope_type 'linear'"):
        load_index(path, tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(SaapIndexError, match="bad.safetensors.*not a readable safetensors"):
        load_index(bad)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other), metadata={"saap": json.dumps({"format": "attnopt-saap-index",
                                                                              "version": 99})})
    with pytest.raises(SaapIndexError, match="other.safetensors: version 99"):
        load_index(other)


def test_build_clusters_csr_matches_the_assignment(trained):
    _, index = trained
    k = torch.randn(2, 2, 300, 16)
    st = build_clusters(index, 1, k, prompt_len=280, sink=2, window=30)
    assert st.indexed_end == 250 and st.perm.shape == (2, 2, 248)
    for b in range(2):
        for h in range(2):
            for c in range(16):
                members = st.perm[b, h, st.offsets[b, h, c]:st.offsets[b, h, c + 1]].long()
                want = (torch.nonzero(st.assign[b, h] == c).flatten() + 2)
                assert sorted(members.tolist()) == want.tolist()
    assert int(st.offsets[..., -1].min()) == 248


def _brute_keep(st: ClusterState, clusters, n_keys):
    B, H, _ = clusters.shape
    keep = torch.zeros(B, H, n_keys, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            keep[b, h, :st.sink] = True
            keep[b, h, st.indexed_end:] = True
            for c in clusters[b, h].tolist():
                keep[b, h, st.perm[b, h, st.offsets[b, h, c]:st.offsets[b, h, c + 1]].long()] = True
    return keep


@pytest.mark.parametrize("probes", [1, 3, 16])
def test_reference_decode_attends_exactly_sink_window_and_clusters(trained, probes):
    _, index = trained
    torch.manual_seed(probes)
    B, Hq, Hkv, N, D = 2, 6, 2, 260, 16
    q, k, v = torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    st = build_clusters(index, 2, k, prompt_len=N - 3, sink=1, window=20)
    o, lse, sel = saap_decode(index, 2, st, q, k, v, probes, 0.25)
    clusters = select_clusters(index, 2, q, torch.tensor([N - 1]), probes, 0.25)
    keep = _brute_keep(st, clusters, N)
    want_o, want_lse = attention_states(q, k, v, attn_mask=keep.repeat_interleave(3, 1)[:, :, None, :], scale=0.25)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(lse, want_lse)
    assert math.isclose(float(sel), float(keep.float().mean()), rel_tol=1e-6)
    if probes == 16:  # every cluster: the exact dense attention
        dense_o, _ = attention_states(q, k, v, scale=0.25)
        torch.testing.assert_close(o, dense_o, atol=1e-5, rtol=1e-5)


def test_the_selection_rule_ranks_bf16_cut_keys_and_breaks_ties_by_the_lowest_index():
    """``top_clusters``: exactly ``probes`` clusters by the scores' top 16 key bits (what the kernel ranks), ties
    broken by the lowest cluster index; the float order otherwise (negatives, -0.0 equal to 0.0, infinities)."""
    from attnopt.runtime.saap.decode import selection_keys, threshold_clusters, top_clusters

    floats = torch.tensor([float("-inf"), -3.0, -1e-30, -0.0, 0.0, 1e-30, 0.7, 0.70001, 2.0, float("inf")])
    keys = selection_keys(floats)
    assert bool((keys[1:] >= keys[:-1]).all()) and int(keys[3]) == int(keys[4])
    assert int(keys[6]) == int(keys[7]) and int(keys[7]) < int(keys[8])  # 0.7 and 0.70001 share their bf16 cut
    assert torch.equal(selection_keys(floats, 32).argsort(stable=True), torch.arange(10))
    scores = torch.tensor([[0.5, 0.70001, 0.1, 0.7, 0.9, 0.7, -0.0, 0.0]])
    assert top_clusters(scores, 3).tolist() == [[4, 1, 3]]  # 0.9, then the first two of the three tied near 0.7
    assert top_clusters(scores, 3, bits=32).tolist() == [[4, 1, 3]]
    assert top_clusters(scores, 7).tolist() == [[4, 1, 3, 5, 0, 2, 6]]  # -0.0 ties 0.0: the lower index
    assert threshold_clusters(scores, 99).all() and int(threshold_clusters(scores, 0).sum()) == 1
    g = torch.Generator().manual_seed(0)
    cut = (0x3F80 + torch.randperm(4096, generator=g, dtype=torch.int32)) << 16  # distinct bf16 values from 1.0 up
    distinct = (cut | torch.randint(0, 1 << 16, cut.shape, generator=g, dtype=torch.int32)).view(torch.float32)
    distinct = distinct.view(2, 2048)
    assert torch.equal(top_clusters(distinct, 77), distinct.topk(77).indices)


def test_multi_token_decode_is_causal_within_the_call(trained):
    _, index = trained
    N = 200
    st = build_clusters(index, 1, torch.randn(1, 2, N, 16), prompt_len=190, sink=1, window=10)
    clusters = torch.tensor([[[0, 1], [2, 3]]])
    keep = attended_keys(st, clusters, N, q_len=4)
    assert keep.shape == (1, 2, 4, N)
    for i in range(4):
        assert not keep[0, :, i, N - 4 + i + 1:].any() and keep[0, :, i, 180:N - 4 + i + 1].all()


def test_torch_kmeans_reaches_a_lloyd_fixed_point_as_good_as_faiss():
    from attnopt.runtime.saap.build import assign_keys
    from attnopt.runtime.saap.train import kmeans

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(600, 8, generator=gen) * torch.linspace(0.5, 3, 8)

    def inertia(c):
        a = assign_keys(c[None], keys[None, None])[0, 0]
        return a, float(((keys - c[a]) ** 2).sum())

    cents = kmeans(keys, 12, iterations=60, seed=1, backend="torch")
    a, mine = inertia(cents)
    assert torch.bincount(a, minlength=12).min() > 0
    means = torch.zeros(12, 8).index_add_(0, a, keys) / torch.bincount(a, minlength=12)[:, None]
    torch.testing.assert_close(cents, means, atol=1e-4, rtol=1e-4)  # each centroid is its keys' mean
    assert mine <= 1.1 * inertia(kmeans(keys, 12, iterations=60, seed=1, backend="faiss"))[1]
    # fewer distinct keys than clusters: the empty clusters are re-seeded, never NaN
    few = kmeans(keys[:3].repeat(20, 1), 5, iterations=5, backend="torch")
    assert torch.isfinite(few).all()
    with pytest.raises(ValueError, match="valid: auto, faiss, torch"):
        kmeans(keys, 6, backend="sklearn")
