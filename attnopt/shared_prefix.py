"""``SharedPrefixCache``: a Hugging Face KV cache for parallel sampling and beam search that keeps the prompt once.

Many rows decoding from one prompt (``num_return_sequences``, beam search, best-of-n) hold the same prompt keys
and values B times in a ``DynamicCache``, and every decode step reads all B copies. This cache keeps the prompt
once per layer, (1, Hkv, P, D), and only the generated tokens per row, (B, Hkv, S, D). Its ``update`` returns what
an attention expects, ``cat([prefix.expand(B, ...), suffix], dim=-2)``: that is the form attnopt's matcher proves to
be a shared prefix (``passes/patterns/prefix.py``), so under ``attnopt.optimize`` the copy is never made and the
cascade plan attends the prompt once for all rows. Without attnopt the cache is still exact (it then makes the copy,
as a ``DynamicCache`` holds it).

Use::

    cache = SharedPrefixCache.prefill(model, prompt_ids[:, :-1])   # batch 1: the prompt, once
    out = model.generate(prompt_ids, past_key_values=cache, do_sample=True, num_return_sequences=16)

``generate`` computes the last prompt token itself (it needs one uncached token) for the 16 rows; that update is
the first with more than one row, and from then on every update goes to the per-row suffixes. Rules:

* the prefix grows while updates come with one row and no suffix exists yet; the first update with B > 1 rows
  starts the suffixes, and later updates must have B rows (beam search reorders and selects them: the prefix is
  shared by every beam, so ``reorder_cache`` and ``batch_select_indices`` touch the suffixes only);
* ``crop`` removes generated tokens from the suffixes (assisted decoding); cropping into the prompt raises;
* one prompt per cache: rows that need different prompts need a cache each (or a ``DynamicCache``).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SharedPrefixLayer(DynamicLayer):
    """One layer: ``prefix_keys``/``prefix_values`` (1, Hkv, P, D) shared by every row, ``keys``/``values``
    (B, Hkv, S, D) each row's own tokens (``None`` until the first update with several rows)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.values = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (rows, Hkv, n, D) new keys/values; return every key/value of each row, (rows, Hkv, P + S, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = key_states.shape[0]
        if self.keys is None and rows == 1:  # still the prompt: one row, shared later
            self.prefix_keys = key_states if self.prefix_keys is None else torch.cat([self.prefix_keys, key_states], -2)
            self.prefix_values = (value_states if self.prefix_values is None
                                  else torch.cat([self.prefix_values, value_states], -2))
            return self.prefix_keys, self.prefix_values
        if self.keys is not None and rows != self.keys.shape[0]:
            raise ValueError(f"SharedPrefixCache: an update with {rows} rows after suffixes of {self.keys.shape[0]} "
                             "rows; every update after the prompt must have the same rows")
        self.keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
        self.values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        if self.prefix_keys is None:
            return self.keys, self.values
        shape = (rows, -1, -1, -1)
        return (torch.cat([self.prefix_keys.expand(shape), self.keys], dim=-2),
                torch.cat([self.prefix_values.expand(shape), self.values], dim=-2))

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    @property
    def suffix_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.prefix_length + self.suffix_length

    def reset(self) -> None:
        self.prefix_keys = self.prefix_values = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` generated tokens (a negative count, as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"SharedPrefixCache.crop takes a negative count of tokens to remove; got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.suffix_length:
            raise ValueError(f"SharedPrefixCache: cannot crop {n} tokens: only {self.suffix_length} generated tokens "
                             f"follow the shared prompt of {self.prefix_length}")
        self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.keys is not None:  # the prompt is every beam's
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keys is not None:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]

    def offload(self):  # the prompt and the suffixes stay where they are
        pass

    def prefetch(self):
        pass


class SharedPrefixCache(Cache):
    """A Hugging Face ``Cache`` whose layers keep one shared prompt and per-row generated tokens (module docstring).
    Pass it as ``past_key_values`` to a model's forward or ``generate``."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=SharedPrefixLayer)

    @classmethod
    @torch.no_grad()
    def prefill(cls, model: torch.nn.Module, prompt_ids: torch.Tensor, **forward_kwargs: Any) -> "SharedPrefixCache":
        """A cache holding ``prompt_ids`` (1, P) computed once by ``model`` (a causal LM). Pass ``generate`` the full
        prompt with at least one token more: it computes the uncached tokens for every row."""
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise ValueError(f"SharedPrefixCache.prefill takes one prompt, (1, P) token ids; got shape "
                             f"{tuple(prompt_ids.shape)}")
        cache = cls()
        model(input_ids=prompt_ids, past_key_values=cache, use_cache=True, **forward_kwargs)
        return cache

    @property
    def prefix_length(self) -> int:
        """Tokens of the shared prompt (layer 0's)."""
        return self.layers[0].prefix_length if self.layers else 0
