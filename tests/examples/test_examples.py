"""The README's first command: ``examples/generate_smollm2.py`` runs the real model through attnopt.

Run in a subprocess, as a user would, with few new tokens; checks the exit code, the generated text, the
tokens/s lines, that attnopt's tokens equal the original's, that the op ran, and the plan table (whose rows
must name the model's attention modules as rewritten), and the plan log it wrote.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from attnopt.hf import ModelNotAvailableError, smollm2_gguf_path  # noqa: E402
from attnopt.report import PlanReport  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "generate_smollm2.py"


def run_example(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    try:
        smollm2_gguf_path()
    except ModelNotAvailableError as exc:
        pytest.skip(str(exc))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNOPT_")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def section(stdout: str, title: str) -> str:
    """The lines after ``=== title ===`` up to the next section."""
    m = re.search(rf"=== {re.escape(title)} ===\n(.*?)(?:\n=== |\Z)", stdout, re.S)
    assert m, f"no section {title!r} in:\n{stdout}"
    return m.group(1)


@pytest.mark.slow
def test_generate_smollm2_defaults_short(tmp_path):
    log = tmp_path / "plans.jsonl"
    proc = run_example("--max-new-tokens", "8", "--prompt", "What is the capital of France?",
                       "--plan-log", str(log))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout

    text = section(out, "generated text (attnopt)").strip()
    assert "Paris" in text, text

    speed = section(out, "speed (greedy, batch 1, after warm-up)")
    rates = re.findall(r"^(original|attnopt)\s*:\s*([0-9.]+) tokens/s\s*\((\d+) tokens", speed, re.M)
    assert [r[0] for r in rates] == ["original", "attnopt"], speed
    assert all(float(r[1]) > 0 and int(r[2]) >= 1 for r in rates), rates
    assert "tokens identical to the original model: yes" in speed

    plans = section(out, "attnopt plans")
    calls = re.search(r"attnopt op calls in the timed run: (\d+)", plans)
    # 30 layers, and at least one decode step when only a few tokens are generated.
    assert calls and int(calls.group(1)) >= 30, plans
    assert re.search(r"all graphs: \d+ attention site\(s\), (\d+) rewritten", plans)
    # The table of the steady-state decode graph: the 30 layers grouped into one row, every one with a plan.
    assert "model.layers.{0..29}.self_attn" in plans, plans
    headline = re.search(r"(\d+) attention site\(s\) in 1 graph\(s\): (\d+) rewritten \((\d+) (dense|split_kv|stream_k)\), "
                         r"(\d+) left alone", plans)
    assert headline and headline.group(1, 2, 3, 5) == ("30", "30", "30", "0"), plans
    row = next(line for line in plans.splitlines() if "model.layers.{0..29}.self_attn" in line)
    assert re.search(r"│\s+30 │", row), row  # the sites column counts the 30 layers

    assert f"attnopt plans {log}" in out
    reports = [PlanReport.from_json(line) for line in log.read_text().splitlines() if line.strip()]
    assert reports and sum(len(r.rewritten) for r in reports) >= 30


@pytest.mark.slow
def test_generate_smollm2_static_eager_no_baseline():
    proc = run_example("--max-new-tokens", "4", "--cache", "static", "--attn", "eager", "--no-baseline",
                       "--table", "none")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "attn eager, cache static" in out
    assert section(out, "generated text (attnopt)").strip()
    speed = section(out, "speed (greedy, batch 1, after warm-up)")
    assert "original" not in speed and re.search(r"attnopt\s*:\s*[0-9.]+ tokens/s", speed)
    plans = section(out, "attnopt plans")
    calls = re.search(r"attnopt op calls in the timed run: (\d+)", plans)
    assert calls and int(calls.group(1)) == 30 * 3, plans  # 3 decode steps after the prefill token
    assert "model.layers.0.self_attn" not in plans  # --table none


def test_generate_smollm2_bad_arguments():
    proc = run_example("--max-new-tokens", "0")
    assert proc.returncode == 2 and "--max-new-tokens must be >= 1" in proc.stderr
    proc = run_example("--dtype", "int3")
    assert proc.returncode == 2 and "unknown dtype" in proc.stderr


DIST_SCRIPT = ROOT / "examples" / "distributed_generate.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["auto", "tree:all_gather"])
def test_distributed_generate_smollm2_two_gloo_ranks(plan):
    """``torchrun`` on 2 gloo ranks: SmolLM2 (30 layers) decodes with its cache sharded over the ranks and its
    greedy tokens and fp32 logits equal one device's. ``auto`` goes through ``attnopt.optimize(model,
    process_group=...)``: with 30 layers dynamo must not fall back to eager (plain SDPA over a shard)."""
    try:
        smollm2_gguf_path()
    except ModelNotAvailableError as exc:
        pytest.skip(str(exc))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNOPT_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DIST_SCRIPT),
           "--plan", plan, "--max-new-tokens", "6"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "greedy tokens identical to one device: True" in out, out
    assert "identical on every rank: True" in out, out
    if plan == "auto":
        m = re.search(r"plan auto: (.*) on (\d+) sites, (\d+) calls", out)
        assert m and ("tree(" in m.group(1) or "ring(" in m.group(1)), out
        assert int(m.group(3)) >= 30 * 5, out  # every layer, every decode step, through the rewritten op
