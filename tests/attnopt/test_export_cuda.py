"""``export_onnx`` on the GPU stack (torch 2.11, onnx 1.23, onnx-ir 1.0, onnxscript 0.7, onnxruntime 1.30 there):
a SmolLM2-shaped decode step on CUDA, planned for the GPU (split-KV / stream-K, or SAAP with an index), exported,
run in onnxruntime (its CUDA execution provider when the installed build has one, else the CPU one), and compared
with PyTorch on CUDA: the original model for the exact plans, the rewritten graph (attnopt's Triton kernels) for
SAAP; Gemma 2 (softcap) and MPT (ALiBi) steps against the rewritten graph. Skipped without CUDA. On a GPU
machine: ``TESTS=tests/attnopt/test_export_cuda.py bash benchmarks/gpu.sh tests``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import export_decode_step, smollm2_shaped  # noqa: E402

pytestmark = pytest.mark.cuda
#: fp32 on both sides; 2 layers of a random-weight model. The GPU's and ORT's fp32 matmuls sum in other orders.
ATOL = 1e-4


def session(path):
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    return ort.InferenceSession(str(path), providers=providers)


def compare(got, want, atol=ATOL):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.detach().float().cpu().numpy(), atol=atol, rtol=0)
    assert int(np.argmax(got[0][0, -1])) == int(want[0][0, -1].argmax())


@pytest.mark.parametrize("force_plan", [None, "split_kv", "stream_k"], ids=["planned", "split_kv", "stream_k"])
def test_smollm2_shaped_decode_step_exports_on_cuda(tmp_path, force_plan):
    model = smollm2_shaped(2).cuda()
    path = tmp_path / "smollm2_cuda.onnx"
    options = {"force_plan": force_plan} if force_plan else {}
    step, inputs, report = export_decode_step(model, path, max_cache_len=64, position=20, **options)
    assert all(s.rewritten and s.chosen.kind in ("split_kv", "stream_k", "dense") for s in report.sites)
    assert all(s.exported_as.startswith("onnx:Attention-24") for s in report.sites), report.format_table(width=200)
    sess = session(path)
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, {n: t.cpu().numpy() for n, t in zip(names, inputs)})
    with torch.no_grad():
        want = step(*[t.clone() for t in inputs])
    compare(got, want)


def test_smollm2_shaped_saap_step_on_cuda_matches_the_triton_kernel(tmp_path):
    """The SAAP function body in onnxruntime against attnopt's SAAP Triton kernel on the GPU."""
    from attnopt.commands.export_onnx import example_step
    from attnopt.config import OptimizeConfig
    from attnopt.export import StaticCacheDecodeStep, export_onnx, rewrite_for_export
    from attnopt.export_saap import saap_cluster_inputs
    from attnopt.runtime.saap import registry
    from attnopt.runtime.saap.build import build_clusters
    from attnopt.runtime.saap.index import synthetic_index

    registry.reset()
    model = smollm2_shaped(2).cuda()
    index_file = str(tmp_path / "smol.safetensors")
    synthetic_index(9, 3, 64, 8, layers=(1,), num_layers=2, seed=1, rope_theta=100000.0).save(index_file)
    step = StaticCacheDecodeStep(model)
    position, max_len = 40, 64
    inputs = example_step(step, batch=1, max_cache_len=max_len, position=position, seed=0)
    registry.set_state(index_file, 1, build_clusters(registry.get_index(index_file, "cuda"), 1, inputs[4], position,
                                                     1, 8))
    options = dict(saap=index_file, saap_probes=2, saap_sink=1, saap_window=8, force_plan="saap")
    path = tmp_path / "smollm2_saap.onnx"
    names = step.cache_names()
    report = export_onnx(step, inputs, path, input_names=["input_ids", "cache_position", *names], **options)
    assert report.sites[1].exported_as == "attnopt:saap_decode_attention (function body)"
    gm, _ = rewrite_for_export(step, inputs, {}, OptimizeConfig(**options))
    sess = session(path)
    feeds = {i.name: t.cpu().numpy() for i, t in zip(sess.get_inputs(), inputs)}
    got = sess.run(None, {**feeds, **saap_cluster_inputs(report, max_len)})
    with torch.no_grad():
        want = gm(*[t.clone() for t in inputs])
    compare(got, want)
    registry.reset()


@pytest.mark.parametrize("arch", ["gemma2", "mpt"])
def test_softcap_and_alibi_steps_export_on_cuda(tmp_path, arch):
    """Gemma 2 (softcap 50, a windowed layer) and MPT (ALiBi) decode steps on CUDA, planned for the GPU: every site
    one Attention-24 node with its variant; ORT matches the rewritten step (the Triton kernels with the cap / the
    slopes) and the original."""
    import attnopt
    from attnopt.export import export_onnx
    from test_export_variants import variant_decode_step

    step, inputs, _ = variant_decode_step(arch, "cuda")
    path = tmp_path / f"{arch}_cuda.onnx"
    report = export_onnx(step, inputs, path)
    assert all(s.rewritten and s.exported_as.startswith("onnx:Attention-24") for s in report.sites), \
        report.format_table(width=200)
    sess = session(path)
    got = sess.run(None, {i.name: t.cpu().numpy() for i, t in zip(sess.get_inputs(), inputs)})
    with torch.no_grad():
        compare(got, [step(*inputs)])
        compare(got, [attnopt.optimize(step)(*inputs)])

