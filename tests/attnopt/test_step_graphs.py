"""attnopt.step_graphs: whole decode steps recorded once and replayed, on the CPU through a stand-in for CUDA graphs.

The stand-in records by running the function once (a real recording runs nothing, and the call's first replay is
its forward: the stand-in skips that first replay instead) and replays by running it again on the same input
buffers and copying the result into the recorded output's tensors, so a replay sees exactly what a graph would:
the input buffers' current values, the cache's tensors in place, the recorded output buffers.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnopt.bench.e2e import build_model, make_cache, prefill  # noqa: E402
from attnopt.step_graphs import StepGraphs  # noqa: E402


class FakeGraphs:
    device_type = "cpu"

    def __init__(self, fail: bool | int = False):
        self.fail = fail  # True: every recording fails; an int: that many first recordings fail
        self.recordings = 0
        self.attempts = 0

    def record(self, fn):
        self.attempts += 1
        if self.fail is True or self.attempts <= int(self.fail):
            raise RuntimeError("operation not permitted when stream is capturing")
        self.recordings += 1
        out = fn()
        return {"fn": fn, "out": out, "first": True}, out

    def replay(self, graph):
        if graph["first"]:  # the recording already ran this call's forward
            graph["first"] = False
            return
        _copy_into(graph["out"], graph["fn"]())


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif hasattr(dst, "keys"):
        for k in dst.keys():
            _copy_into(dst[k], src[k])
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("tiny", layers=None, dtype=torch.float32, device="cpu", max_positions=256)
    return m


def _decode(model, forward, steps=8, prompt=20, cache_kind="static", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g)
    cache = make_cache(model, cache_kind, prompt + steps + 4)
    with torch.no_grad():
        tok = prefill(model, cache, ids, chunk=64)
        tokens, logits = [int(tok)], []
        for i in range(steps):
            pos = torch.tensor([prompt + i])
            out = forward(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)
            logits.append(out.logits)
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(int(tok))
    return tokens, logits


def test_replayed_steps_give_the_forwards_tokens_and_logits(model):
    want_tokens, want_logits = _decode(model, model.forward)
    replays = []
    steps = StepGraphs(model.forward, model, lambda: replays.append(1), graphs=FakeGraphs())
    got_tokens, got_logits = _decode(model, lambda **kw: steps((), kw))
    assert got_tokens == want_tokens
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert steps.graphs.recordings == 1 and steps.replays == 8 - 2  # two warm compiled calls, then replays
    assert len(replays) == steps.replays
    # outputs are clones: a later replay does not change what an earlier call returned
    assert got_logits[-1].data_ptr() != got_logits[-2].data_ptr()


def test_a_new_cache_or_a_replaced_parameter_is_recorded_again(model):
    steps = StepGraphs(model.forward, model, lambda: None, graphs=FakeGraphs())
    call = lambda **kw: steps((), kw)  # noqa: E731
    _decode(model, call, steps=5)
    _decode(model, call, steps=5, seed=1)  # another cache object: another signature
    assert steps.graphs.recordings == 2
    cache_b = make_cache(model, "static", 40)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        tok = prefill(model, cache_b, ids, chunk=64)
        for i in range(5):  # warm, warm, record, replay, replay: one recording for this cache
            call(input_ids=tok, past_key_values=cache_b, cache_position=torch.tensor([8 + i]), use_cache=True)
        assert steps.graphs.recordings == 3
        weight = model.lm_head.weight
        try:  # a replaced parameter: the graph would read the old one's memory; the signature records again
            model.lm_head.weight = torch.nn.Parameter(weight.detach().clone())
            for i in range(5, 8):
                call(input_ids=tok, past_key_values=cache_b, cache_position=torch.tensor([8 + i]), use_cache=True)
            assert steps.graphs.recordings == 4
        finally:
            model.lm_head.weight = weight
        for i in range(8, 11):  # the original weight back: recorded again
            call(input_ids=tok, past_key_values=cache_b, cache_position=torch.tensor([8 + i]), use_cache=True)
        assert steps.graphs.recordings == 5
        mlp = model.model.layers[1].mlp
        try:  # a submodule swapped for a copy (new parameters, in a module the recording never saw): again
            import copy

            model.model.layers[1].mlp = copy.deepcopy(mlp)
            for i in range(11, 14):
                call(input_ids=tok, past_key_values=cache_b, cache_position=torch.tensor([8 + i]), use_cache=True)
            assert steps.graphs.recordings == 6
            replays = steps.replays
            handle = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * 0.5)
            try:  # a hook on the swapped-in module (its hook dicts are new): not skipped by a replay
                call(input_ids=tok, past_key_values=cache_b, cache_position=torch.tensor([22]), use_cache=True)
                assert steps.replays == replays
            finally:
                handle.remove()
        finally:
            model.model.layers[1].mlp = mlp


def test_a_cache_whose_layer_or_tensor_was_replaced_is_recorded_again(model):
    """The graph writes into the cache's tensors in place: a layer object or a key tensor put in their place since
    the recording (a cache re-allocated by hand, an offloading layer) must not be replayed against."""
    import copy

    steps = StepGraphs(model.forward, model, lambda: None, graphs=FakeGraphs())
    cache = make_cache(model, "static", 40)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        tok = prefill(model, cache, ids, chunk=64)
        step = iter(range(8, 40))

        def call():
            return steps((), {"input_ids": tok, "past_key_values": cache,
                              "cache_position": torch.tensor([next(step)]), "use_cache": True})

        for _ in range(4):  # warm, warm, record, replay
            call()
        assert steps.graphs.recordings == 1 and steps.replays == 2
        layer = cache.layers[1]
        cache.layers[1] = copy.copy(layer)  # another object (its tensors the same): the recording is stale
        call()
        assert steps.replays == 2  # ran compiled
        call()
        assert steps.graphs.recordings == 2 and steps.replays == 3
        cache.layers[1].keys = cache.layers[1].keys.clone()  # a key tensor moved: again
        call()
        assert steps.replays == 3
        call()
        assert steps.graphs.recordings == 3 and steps.replays == 4
        del cache.layers[1].values  # a tensor gone: never replayed against
        with pytest.raises(AttributeError):
            call()
        assert steps.replays == 4


def test_grad_mode_cpu_tensors_and_unknown_arguments_run_the_forward(model):
    calls = []

    def forward(**kw):
        calls.append(1)
        return model.forward(**kw)

    steps = StepGraphs(forward, model, lambda: None, graphs=FakeGraphs())
    ids = torch.randint(0, model.config.vocab_size, (1, 1))
    with torch.enable_grad():
        for _ in range(4):
            steps((), {"input_ids": ids})
    assert steps.graphs.recordings == 0 and len(calls) == 4
    for _ in range(4):
        with torch.no_grad():
            steps((), {"input_ids": ids, "extra": object()})
    assert steps.graphs.recordings == 0 and len(calls) == 8
    assert steps.fallbacks == {"grad mode is on": 4, "an argument of type object": 4}


def test_a_forward_that_mutates_an_input_or_python_state_is_never_recorded(model):
    def mutating(**kw):
        kw["cache_position"].add_(0)  # bumps the version: a copy of it would take the write instead
        return model.forward(**kw)

    steps = StepGraphs(mutating, model, lambda: None, graphs=FakeGraphs())
    want, _ = _decode(model, model.forward, steps=6)
    got, _ = _decode(model, lambda **kw: steps((), kw), steps=6)
    assert got == want and steps.graphs.recordings == 0

    class Counting:  # a cache-like object whose Python counter a replay would not advance
        is_compileable = True
        layers = ()

        def __init__(self):
            self.seen = 0

    def counting_forward(**kw):
        kw["past_key_values"].seen += 1
        return kw["input_ids"] * 2

    cache = Counting()
    fallback_calls = []

    def fallback(**kw):
        fallback_calls.append(1)
        return counting_forward(**kw)

    steps = StepGraphs(counting_forward, model, lambda: None, graphs=FakeGraphs(), fallback=fallback)
    with torch.no_grad():
        for _ in range(5):
            steps((), {"input_ids": torch.ones(1, 1), "past_key_values": cache})
    assert cache.seen == 5 and steps.graphs.recordings == 0
    assert len(fallback_calls) == 5 - 1  # after the compiled call that found the Python state


def test_a_failed_recording_warns_once_and_runs_the_forward(model):
    steps = StepGraphs(model.forward, model, lambda: None, graphs=FakeGraphs(fail=True))
    want, _ = _decode(model, model.forward, steps=6)
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        got, _ = _decode(model, lambda **kw: steps((), kw), steps=6)
    assert got == want and steps.replays == 0 and steps.graphs.attempts == 3
    assert steps.fallbacks["signature refused"] == 1  # calls 3-5 tried, 6 refused


def test_a_recording_that_failed_once_is_tried_again(model, recwarn):
    """A transient failure (seen once among six benchmark processes on one H100) costs one compiled call, not the
    signature: the next call records it."""
    steps = StepGraphs(model.forward, model, lambda: None, graphs=FakeGraphs(fail=1))
    want, _ = _decode(model, model.forward, steps=7)
    got, _ = _decode(model, lambda **kw: steps((), kw), steps=7)
    assert got == want and steps.graphs.attempts == 2 and steps.graphs.recordings == 1
    assert steps.replays == 7 - 2 - 1 and not steps.refused  # two warm calls, one failed try
    assert not [w for w in recwarn if "could not be recorded" in str(w.message)]


def test_optimize_reduce_overhead_uses_step_graphs_on_static_caches_only(model):
    """Through the public API on the CPU: the route exists and the tokens are the model's; recording needs CUDA, so
    every call here runs the compiled forward (CPU tensors are not recorded)."""
    import attnopt

    opt = attnopt.optimize(model, inner_backend="eager", mode="reduce-overhead")
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(opt.generate(ids, **kw), model.generate(ids, **kw))
    assert opt._attnopt_step_graphs.replays == 0
    assert attnopt.last_plans(opt).calls_without_attnopt == 0
    off = attnopt.optimize(model, inner_backend="eager", mode="reduce-overhead", step_graphs=False)
    assert not hasattr(off, "_attnopt_step_graphs")


def test_a_forward_hook_added_after_recording_is_not_skipped(model):
    """A hook that edits a layer's output (a steering vector) added after the step was recorded: a replay would
    silently skip it; the signature counts hooks, so the call runs the forward, with the hook."""
    steps = StepGraphs(model.forward, model, lambda: None, graphs=FakeGraphs())
    layer = model.model.layers[0].mlp

    def steer(module, args, output):
        return output + 1.0

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    cache = make_cache(model, "static", 40)
    with torch.no_grad():
        tok = prefill(model, cache, ids, chunk=64)
        kw = lambda i: dict(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([12 + i]),  # noqa: E731
                            use_cache=True)
        for i in range(4):  # two warm calls, a recording, a replay
            steps((), kw(i))
        assert steps.replays == 2
        reference_cache = make_cache(model, "static", 40)
        prefill(model, reference_cache, ids, chunk=64)
        for i in range(4):  # the reference: the same four steps through the plain forward ...
            model.forward(input_ids=tok, past_key_values=reference_cache, cache_position=torch.tensor([12 + i]),
                          use_cache=True)
        handle = layer.register_forward_hook(steer)
        try:
            want = model.forward(input_ids=tok, past_key_values=reference_cache, cache_position=torch.tensor([16]),
                                 use_cache=True).logits  # ... then the hooked fifth
            got = steps((), kw(4)).logits
        finally:
            handle.remove()
    assert steps.replays == 2  # not replayed
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_each_new_cache_is_recorded_at_its_first_call_and_forgotten_with_its_cache(model):
    """generate() makes a StaticCache per call: a new cache in a Python state (sizes, flags) that a compiled call of
    the signature ran over and kept is recorded at its first call; one of another size takes a compiled call first.
    A recording goes when its cache does (it pins the cache's tensors: they would stay allocated)."""
    import gc

    calls = []

    def forward(**kw):
        calls.append(1)
        return model.forward(**kw)

    class Forgetful(FakeGraphs):  # a graph keeps no Python objects; the stand-in's replay would keep the cache
        def record(self, fn):
            handle, out = super().record(fn)
            return {"first": True, "fn": None}, out

        def replay(self, graph):
            graph["first"] = False

    steps = StepGraphs(forward, model, lambda: None, graphs=Forgetful())
    for seed in range(3):
        _decode(model, lambda **kw: steps((), kw), steps=5, seed=seed)
    assert steps.graphs.recordings == 3
    # of 15 calls: 2 compiled for the first cache and none for the later ones (the stand-in's recording runs the
    # forward once more, a real one does not); the other 13 are replays, each recording's first one included
    assert len(calls) - steps.graphs.recordings == 2
    assert steps.replays == 15 - 2
    _decode(model, lambda **kw: steps((), kw), steps=5, prompt=28)  # a longer cache: its state was never seen
    assert steps.graphs.recordings == 4 and len(calls) - steps.graphs.recordings == 2 + 1
    gc.collect()
    assert steps.recorded == {}  # the three caches are gone, and so are their recordings


def test_an_argument_that_views_the_cache_runs_the_forward():
    """An argument sharing memory with the cache would be copied into the graph's buffer and miss the forward's
    writes to the cache, which the original sees; such a call runs the compiled forward instead of a replay."""
    class Layer:
        def __init__(self):
            self.keys = torch.zeros(4)

    class Cache:
        is_compileable = True

        def __init__(self):
            self.layers = [Layer()]

    def forward(x, past_key_values):
        past_key_values.layers[0].keys.add_(1.0)  # the step writes the cache, then reads its argument
        return {"out": x * 2.0}

    cache = Cache()
    steps = StepGraphs(forward, torch.nn.Linear(1, 1), lambda: None, graphs=FakeGraphs())
    with torch.no_grad():
        for _ in range(4):
            steps((), {"x": torch.ones(4), "past_key_values": cache})
        assert steps.replays == 2
        view = cache.layers[0].keys
        got = steps((), {"x": view, "past_key_values": cache})["out"]
    assert steps.replays == 2
    # four calls wrote the cache (two compiled, the recording's, one replay), the fifth's write is seen: 2 * (4 + 1)
    torch.testing.assert_close(got, torch.full((4,), 10.0))


def test_a_failed_capture_ends_its_pool_routing_and_later_recordings_take_a_new_pool(monkeypatch):
    """CudaGraphs, with CUDA's calls stood in: a capture that fails leaves PyTorch's allocator routing into the pool
    (every later capture there failed on the H100: "already recording to mempool_id"), so the routing is ended and
    the next recording gets a pool of its own."""
    import contextlib
    import gc

    from attnopt.step_graphs import CudaGraphs

    pools, ended, captures = iter(range(100)), [], []

    @contextlib.contextmanager
    def graph(g, pool, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"  # another thread's CUDA call must not invalidate the capture
        assert not gc.isenabled()  # a collection inside the capture could free another pool's memory (cudaFree)
        captures.append(pool)
        yield
        if len(captures) == 1:
            raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(pools)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: ended.append((dev, pool)),
                        raising=False)
    graphs = CudaGraphs()
    with pytest.raises(RuntimeError, match="previous error"):
        graphs.record(lambda: 1)
    assert ended == [(0, ("pool", 0))]
    assert graphs.record(lambda: 2)[1] == 2 and graphs.record(lambda: 3)[1] == 3
    assert captures == [("pool", 0), ("pool", 1), ("pool", 1)]  # a new pool after the failure, then shared
    assert gc.isenabled()  # collection is back on after a failed capture and after good ones


def _step_kw(tok, cache, i):
    return dict(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([12 + i]), use_cache=True)


def _recorded_steps(model, forward=None):
    """StepGraphs over a fresh cache after four calls (two warm, the recording, one fast-path replay)."""
    steps = StepGraphs(forward or model.forward, model, lambda: None, graphs=FakeGraphs())
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = make_cache(model, "static", 48)
    with torch.no_grad():
        tok = prefill(model, cache, ids, chunk=64)
        for i in range(4):
            steps((), _step_kw(tok, cache, i))
    assert steps.replays == 2 and steps._hot is not None
    return steps, tok, cache


def test_generate_replays_every_decode_token_after_the_warm_calls(model):
    """generate() through optimize() with the recording stood in: the signature of its decode calls (the 4D mask, the
    cache, the flags) holds from token to token, so every decode call after the two warm ones replays, on the fast
    path, and the tokens are the model's own."""
    import attnopt

    opt = attnopt.optimize(model, inner_backend="eager", mode="reduce-overhead")
    steps = opt._attnopt_step_graphs
    steps.graphs = FakeGraphs()
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static")
    assert torch.equal(opt.generate(ids, **kw), model.generate(ids, **kw))
    assert steps.graphs.recordings == 1 and steps.replays == 11 - 2 and not steps.fallbacks
    before = steps.replays
    assert torch.equal(opt.generate(ids, **kw), model.generate(ids, **kw))
    # a new cache object of the same size (this transformers makes one per call) is recorded at its first call: every
    # decode call of the second generate() replays
    assert steps.graphs.recordings in (1, 2) and steps.replays - before == 11 and not steps.fallbacks


def test_the_fast_path_replays_only_the_same_signature(model):
    """The fast path compares the call with the last replayed recording: another shape, dtype, plain value, argument
    name or cache runs through the full signature (and compiled, until recorded in turn), never the wrong graph."""
    calls = []

    def forward(**kw):
        calls.append(1)
        return model.forward(**kw)

    steps, tok, cache = _recorded_steps(model, forward)
    n = len(calls)
    with torch.no_grad():
        variants = [dict(_step_kw(tok, cache, 4), use_cache=False),                 # a plain value
                    dict(_step_kw(tok, cache, 4), cache_position=torch.tensor([16], dtype=torch.int32)),  # a dtype
                    dict(_step_kw(tok.repeat(1, 2), cache, 4), cache_position=torch.tensor([16, 17])),   # a shape
                    {k: v for k, v in reversed(_step_kw(tok, cache, 4).items())},    # the names' order
                    dict(_step_kw(tok, cache, 4), past_key_values=make_cache(model, "static", 48))]  # a cache
        for kw in variants:
            steps((), kw)
    assert steps.replays == 2 and len(calls) == n + len(variants)


def test_a_config_change_or_a_moved_parameter_is_not_replayed(model):
    """What dynamo would guard on and a replay skips: a config attribute changed after the recording, or a parameter
    whose memory moved under the same object (``.data =``), records again instead of replaying the stale graph."""
    steps, tok, cache = _recorded_steps(model)
    with torch.no_grad():
        model.config.rope_theta_probe = 1.0  # any attribute of the config: the forward may read it
        try:
            steps((), _step_kw(tok, cache, 4))
            assert steps.replays == 2
            steps((), _step_kw(tok, cache, 5))  # recorded again, with the config as it is now
            assert steps.graphs.recordings == 2 and steps.replays == 3
        finally:
            del model.config.rope_theta_probe
        steps((), _step_kw(tok, cache, 6))  # the config changed back: again
        steps((), _step_kw(tok, cache, 7))
        assert steps.graphs.recordings == 3
        model.model.norm.probe = torch.nn.Identity()  # a child added to a leaf module: again
        try:
            steps((), _step_kw(tok, cache, 8))
            assert steps.graphs.recordings == 3 and steps.replays == 4  # ran compiled
        finally:
            del model.model.norm.probe
        weight = model.model.norm.weight
        old = weight.data
        try:
            steps((), _step_kw(tok, cache, 9))  # (the leaf's dict as recorded: recorded again, replayed)
            assert steps.graphs.recordings == 4 and steps.replays == 5
            weight.data = old.clone()
            steps((), _step_kw(tok, cache, 10))
            assert steps.replays == 5  # ran compiled
        finally:
            weight.data = old


def test_a_registered_hook_is_never_recorded(model):
    """A forward hook is Python a replay would skip: while one is registered the calls run the fallback, and once it
    is removed the signature is recorded again."""
    fallback_calls = []

    def fallback(**kw):
        fallback_calls.append(1)
        return model.forward(**kw)

    steps, tok, cache = _recorded_steps(model)
    steps.fallback = fallback
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(1))
    with torch.no_grad():
        try:
            for i in range(4, 9):
                steps((), _step_kw(tok, cache, i))
        finally:
            handle.remove()
        assert steps.replays == 2 and len(seen) == 5 and len(fallback_calls) == 5  # never replayed nor recorded
        for i in range(9, 12):  # without the hook: compiled once (the recording went), recorded, replayed
            steps((), _step_kw(tok, cache, i))
    assert steps.graphs.recordings == 2 and steps.replays == 4


def test_hugging_faces_output_capturing_hooks_block_only_calls_that_ask_for_outputs(model):
    """After one call with output_hidden_states=True, transformers keeps its output-capturing hooks on the modules for
    good; in a call that asks for no attentions or hidden states they return at once, so such calls still replay.
    A call that asks for hidden states runs the forward (the hooks collect them), with the model's own answer."""
    import copy

    from transformers.utils import output_capturing

    m = copy.deepcopy(model)
    with torch.no_grad():
        m(input_ids=torch.ones(1, 3, dtype=torch.long), output_hidden_states=True)
    hooks = [h for mod in m.modules() for h in mod._forward_hooks.values()]
    if not hooks or not all(h.__module__ == output_capturing.__name__ for h in hooks):
        pytest.skip("this transformers installs no output-capturing hooks")
    steps, tok, cache = _recorded_steps(m)
    assert steps.graphs.recordings == 1 and not steps.fallbacks
    with torch.no_grad():
        out = steps((), dict(_step_kw(tok, cache, 4), output_hidden_states=True))
    assert steps.replays == 2 and out.hidden_states is not None and len(out.hidden_states) > 1
    assert steps.fallbacks == {"a forward hook is registered (a replay would skip it)": 1}
