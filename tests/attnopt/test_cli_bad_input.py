"""Bad input to the ``attnopt`` commands: exit status 2 and one line naming the option and what is valid, before any
work (no model loaded, no GPU looked for, nothing measured), never a traceback. Each case runs in well under a
second: a case that got past its check would load a model or fail on the missing GPU instead, and say so."""
from __future__ import annotations

import pytest
import torch

from attnopt.cli import main


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    return rc, capsys.readouterr().err


CASES = {
    # attnopt tune: the shapes and numbers are checked before the GPU is looked for
    "tune-gqa": (["tune", "32/5x128"], "multiple of KV heads"),
    "tune-head-dim": (["tune", "32/8x0"], "head dim must be >= 1"),
    "tune-context": (["tune", "32/8x128", "--context", "abc"], "--context 'abc'"),
    "tune-batch": (["tune", "llama3-8b", "--batch", "0"], "--batch '0'"),
    "tune-q-len": (["tune", "llama3-8b", "--q-len", "17"], "at most 16"),
    "tune-budget": (["tune", "llama3-8b", "--budget", "-1"], "--budget -1.0"),
    # attnopt explain: the plot's file (matplotlib wrote a folder's name + .png, and said it wrote the folder)
    "explain-plot-folder": (["explain", "--plot", "{tmp}"], "is a directory"),
    "explain-plot-format": (["explain", "--plot", "{tmp}/plot"], "must end in one of .avif"),
    # a shape the optimizer calls prefill and leaves alone was ranked as if it were decode
    "explain-prefill": (["explain", "--context", "2", "--q-len", "4"], "is prefill, which attnopt leaves alone"),
    # absurd but well-formed what-ifs were ranked (a 10^22-key cache); refused naming the valid range
    "explain-context-huge": (["explain", "--context", "10000000000000000000000"], "must be from 1 to 2147483647 keys"),
    "explain-context-huge-suffix": (["explain", "--context", "4096M"], "must be from 1 to 2147483647 keys"),
    "explain-context-exponent": (["explain", "--context", "1e22"], "131072, 128k or 1M, from 1 to 2147483647 keys"),
    "explain-batch-huge": (["explain", "--batch", "100000000000000"], "--batch 100000000000000: valid from 1 to"),
    "tune-context-huge": (["tune", "32/8x128", "--context", "10000000000000000000000"], "from 1 to 2147483647 keys"),
    # attnopt calibrate
    "calibrate-profile": (["calibrate", "--profile", "nosuch"], "valid names: a100-80gb"),
    "calibrate-random": (["calibrate", "--random", "-3"], "--random -3"),
    "calibrate-budget": (["calibrate", "--budget", "0"], "--budget 0.0"),
    "calibrate-out": (["calibrate", "--validate", "--out", "{tmp}"], "is a directory"),
    # attnopt bench (argparse types)
    "dispatch-calls": (["bench", "dispatch", "--calls", "0"], "argument --calls: must be an integer >= 1, got '0'"),
    "bench-out-folder": (["bench", "variants", "--smoke", "--out", "{tmp}"], "--out='"),
    "e2e-device": (["bench", "e2e", "--device", "nosuch"], "expected cuda, cuda:N or cpu"),
    "e2e-steps": (["bench", "e2e", "--device", "cpu", "--steps", "0"], "argument --steps"),
    # a prompt length below 1 reached the model: a negative dimension (RuntimeError) or no logits (TypeError)
    "e2e-contexts-zero": (["bench", "e2e", "--device", "cpu", "--contexts", "1k,0"], "--contexts: bad context '0'"),
    "e2e-contexts-negative": (["bench", "e2e", "--device", "cpu", "--contexts", "-1"], "--contexts: bad context '-1'"),
    # a negative timeout ran the whole suite (on the CPU, minutes); an unknown method exited 1 without "error:"
    "e2e-timeout": (["bench", "e2e", "--device", "cpu", "--timeout", "-5"], "argument --timeout: must be a number > 0"),
    "e2e-methods": (["bench", "e2e", "--device", "cpu", "--methods", "bogus"], "unknown method 'bogus'; valid:"),
    "kernels-time-budget": (["bench", "kernels", "--time-budget", "-1"], "argument --time-budget: must be a number >= 0"),
    "multigpu-timeout": (["bench", "multigpu", "--timeout", "nan"], "argument --timeout: must be a number > 0"),
    "planner-smoke-cases": (["bench", "planner", "--smoke", "--cases", "bogus"], "--smoke runs its three fixed cases"),
    "planner-time-budget": (["bench", "planner", "--time-budget", "inf"], "argument --time-budget"),
    "train-lr": (["saap", "train", "{junk}", "--out", "{tmp}/i.safetensors", "--lr", "-1"], "argument --lr"),
    # attnopt export-onnx: checked before the model loads
    "export-cache-len": (["export-onnx", "smollm2", "{tmp}/x.onnx", "--max-cache-len", "0"], "--max-cache-len must"),
    "export-opset": (["export-onnx", "smollm2", "{tmp}/x.onnx", "--opset", "5"], "--opset 5: valid: 23, 24"),
    "export-plan": (["export-onnx", "smollm2", "{tmp}/x.onnx", "--plan", "bogus"], "valid: bucketed"),
    "export-out": (["export-onnx", "smollm2", "{tmp}"], "is a directory"),
    # attnopt saap
    "collect-context": (["saap", "collect", "--context", "0", "--out", "{tmp}/c.safetensors"], "argument --context"),
    "collect-out": (["saap", "collect", "--out", "{tmp}"], "is a directory"),
    "train-collection": (["saap", "train", "{junk}", "--out", "{tmp}/i.safetensors"], "not a readable safetensors"),
    "train-device": (["saap", "train", "{junk}", "--out", "{tmp}/i.safetensors", "--device", "tpu"], "cuda:N or cpu"),
    "eval-index": (["saap", "eval", "--index", "{tmp}/none.safetensors"], "no such file"),
    "eval-methods": (["saap", "eval", "--index", "{junk}", "--methods", "mlp,bogus"], "valid methods: mlp, centroids"),
    "eval-targets": (["saap", "eval", "--index", "{junk}", "--targets", "2"], "fractions in (0, 1]"),
    # a corrupt index and a model that is neither 'smollm2' nor a folder: named before the model loads (the index
    # was read after it; the model's name reached transformers, which spoke of connecting to the hub)
    "eval-corrupt-index": (["saap", "eval", "--index", "{junk}"], "is not a readable safetensors file"),
    "eval-model": (["saap", "eval", "--index", "{junk}", "--model", "nosuch"], "--model 'nosuch': expected 'smollm2'"),
    "collect-model": (["saap", "collect", "--model", "nosuch", "--out", "{tmp}/c.safetensors"], "no such folder"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(name, tmp_path, capsys, monkeypatch):
    import attnopt.commands.export_onnx as export_command
    import attnopt.commands.saap as saap_command

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(export_command, "build_model", no_model)
    monkeypatch.setattr(saap_command, "_load_model", no_model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    argv, fragment = CASES[name]
    argv = [a.format(tmp=tmp_path, junk=junk) for a in argv]
    rc, err = run_cli(argv, capsys)
    assert rc == 2, err
    assert fragment in err, err
    assert "Traceback" not in err and "CUDA" not in err, err


def test_saap_eval_methods_match_the_evaluator():
    from attnopt.commands.saap import EVAL_METHODS
    from attnopt.runtime.saap.evaluate import METHODS

    assert tuple(EVAL_METHODS) == tuple(METHODS)
