"""The ONNX translation of attnopt's ops: ``OnnxTranslator``, the ``custom_translation_table`` that
``attnopt.export.export_onnx`` hands to ``torch.onnx.export``, and the plan kinds each form exports.

Which plan becomes which ONNX node, and why, is written in ``attnopt/export.py``'s docstring; this module holds
the checks that refuse a graph before the export starts, and the onnxscript translations of
``attnopt::decode_attention``, ``decode_attention_states``, ``merge_states`` and the mask-derived lengths.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

import torch


#: Opsets with the standard ``Attention`` node.
OPSETS = (23, 24)
#: ``attention=``: "auto" (standard where it fits), "standard" (raise where it does not), "function" (every site
#: as an attnopt domain node with a function body).
ATTENTION_FORMS = ("auto", "standard", "function")
#: Plan kinds whose attention is exact over the keys the node is given, so one standard ``Attention`` node computes
#: what the plan computes.
STANDARD_KINDS = ("dense", "split_kv", "stream_k", "tree", "ring")
#: Sequence-parallel kinds, exported as their single-device equivalent: an ONNX graph has no process group, so the
#: node attends over the whole cache the graph is given, which is exactly what the plan's local attention plus its
#: collective merge compute (see ``attnopt/export.py``'s docstring).
SINGLE_DEVICE_KINDS = ("tree", "ring")
#: Kinds that are not exact attention: an ``attnopt`` node with a function body computing what the plan computes.
FUNCTION_KINDS = ("saap",)
#: Kinds that stand for another plan: a bucketed plan exports as the plan of the bucket of the exported KV length.
RESOLVED_KINDS = ("bucketed",)
EXPORTABLE_KINDS = STANDARD_KINDS + FUNCTION_KINDS + RESOLVED_KINDS

_ONNX_FLOAT, _ONNX_BOOL, _ONNX_INT64 = 1, 9, 7


class OnnxTranslator:
    """The ``custom_translation_table`` of one export: translations of attnopt's ops, and a record of what each
    site became (``exported``: site key -> form) and which function bodies the model needs."""

    def __init__(self, opset: int, attention: str = "auto"):
        self.opset = opset
        self.attention = attention
        self.exported: dict[str, str] = {}
        self.functions: set[str] = set()

    # ----------------------------------------------------------------------------------------- checks
    def resolve(self, plan: str, kv_len: int | None = None, states: bool = False) -> tuple[str, str, str]:
        """(form, plan, note) of a site's plan key at KV length ``kv_len`` (None when not static): form is "standard"
        (one ``Attention`` node), "function" (``attnopt:decode_attention`` with its body) or "saap"; plan is the key
        of the plan that runs (a bucketed plan's bucket at ``kv_len``); note says how a plan became its export.
        ``ValueError`` naming the exportable kinds for anything else, before any export work."""
        from .plan import plan_from_json

        kind = json.loads(plan).get("kind", "?")
        if kind not in EXPORTABLE_KINDS:
            raise ValueError(f"no ONNX export for plan kind {kind!r}; exportable kinds: {', '.join(EXPORTABLE_KINDS)}")
        if kind == "bucketed":
            bucketed = plan_from_json(plan)
            if kv_len is not None:
                form, inner, note = self.resolve(bucketed.plan_for(kv_len), kv_len, states)
                described = f"bucketed: {json.loads(inner)['kind']} at N={kv_len}"
                return form, inner, "; ".join(x for x in (described, note) if x)
            inner_forms = {self.resolve(p, None, states)[0] for p in bucketed.plans}
            if inner_forms != {self.exact_form()}:
                raise ValueError(f"a bucketed plan ({bucketed.describe()}) whose buckets export differently needs a "
                                 "static KV length to pick its bucket; export with static shapes")
            return inner_forms.pop(), plan, "bucketed: every bucket exact"
        note = f"{kind} plan, single-device equivalent" if kind in SINGLE_DEVICE_KINDS else ""
        if kind in FUNCTION_KINDS:
            if self.attention == "standard":
                raise ValueError(f"a {kind} plan is not exact attention and has no standard ONNX node; export with "
                                 "attention='auto' or 'function' (an attnopt node with a function body)")
            if states:
                raise ValueError(f"a {kind} plan exports through attnopt::decode_attention only, not its softmax "
                                 "states (decode_attention_states)")
            return "saap", plan, note
        return self.exact_form(), plan, note

    def exact_form(self) -> str:
        """The form of an exact-attention site: "function" with ``attention="function"``, else "standard"."""
        return "function" if self.attention == "function" else "standard"

    def check_graph(self, gm: torch.fx.GraphModule) -> None:
        """Raise before exporting when a lowered op carries a plan that cannot be exported, or ``attention``
        asks for standard nodes where there are none."""
        import attnopt.runtime.ops  # noqa: F401  (registers torch.ops.attnopt.*)

        ops = torch.ops.attnopt
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in (ops.decode_attention.default, ops.decode_attention_states.default):
                states = node.target == ops.decode_attention_states.default
                k = node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None
                form, runs, _ = self.resolve(node.args[7], _static(k.shape[2]) if k is not None else None, states)
                q = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
                self._check_variant(node, "function" if states else form)
                form, _ = self._variant_form(node.name, form, float(node.kwargs.get("softcap") or 0.0),
                                             node.kwargs.get("alibi_slopes") is not None,
                                             getattr(q, "dtype", None) in (torch.float16, torch.bfloat16))
                is_function = form != "standard" or states
                if is_function and getattr(q, "dtype", None) == torch.float64:
                    raise ValueError("attnopt's ONNX function bodies compute in float32, less precise than this "
                                     "float64 attention; export it with attention='auto' (a standard Attention node)")
                if form == "saap":
                    from .export_saap import check_saap

                    check_saap(runs, q, k, node.args[8])
            if node.target in (ops.decode_attention_states.default, ops.merge_states.default) and self.attention == "standard":
                raise ValueError(f"{node.target} has no standard ONNX node (softmax states); export with "
                                 "attention='auto' or 'function' to write it as an attnopt node with a function body")
            if node.target in (ops.check_close.default, ops.shard_mask_columns.default):
                raise ValueError(f"{node.target} cannot be exported to ONNX (a run-time check / a sharded cache)")
            if getattr(node.target, "namespace", None) == "attnopt" and node.target not in self.table():
                names = ", ".join(sorted(str(op) for op in self.table()))
                raise ValueError(f"{node.target} has no ONNX translation; attnopt ops that export: {names}")

    def _check_variant(self, node: torch.fx.Node, form: str) -> None:
        """A softcapped or ALiBi site exports as its plan's form (ALiBi folded into the mask, the cap as the
        ``Attention`` node's ``softcap``), except a negative cap, which ``Attention`` (``softcap > 0``) cannot take
        and only the function body computes; SAAP has neither."""
        if form == "saap" and (node.kwargs.get("softcap") or node.kwargs.get("alibi_slopes") is not None):
            raise ValueError(f"{node.name}: a saap plan has no logit softcapping or ALiBi; exportable for this site: "
                             "dense, split_kv, stream_k, tree, ring")

    def _variant_form(self, name: str, form: str, softcap: float, alibi: bool, low_precision: bool) -> tuple[str, str]:
        """(form, why) of a site with a variant: a standard one becomes the function body where ``Attention``
        would not compute what attnopt does. A negative cap: Attention's ``softcap`` must be > 0. ALiBi with fp16 /
        bf16 Q: Attention's mask has Q's type, and ``slope * j`` rounded to fp16 is off by up to 8 at j = 16k
        (the kernels add it in fp32; the body casts its bias to fp32)."""
        if form != "standard":
            return form, ""
        if softcap < 0:
            why = f"softcap={softcap:g} is negative, which the standard Attention node's softcap (> 0) cannot express"
        elif alibi and low_precision:
            why = "ALiBi's bias in a half-precision mask is rounded (the kernels add it in fp32)"
        else:
            return form, ""
        if self.attention == "standard":
            raise ValueError(f"{name}: {why}; export with attention='auto' or 'function' (the function body)")
        return "function", why.split(",")[0].split(" (")[0]

    # ----------------------------------------------------------------------------------------- translations
    def table(self) -> dict[Any, Callable]:
        import attnopt.runtime.ops  # noqa: F401

        ops = torch.ops.attnopt
        # The exporter tags each translation with its signature: plain functions, not bound methods.
        return {ops.decode_attention.default: _plain(self.decode_attention),
                ops.decode_attention_states.default: _plain(self.decode_attention_states),
                ops.merge_states.default: _plain(self.merge_states),
                ops.valid_len_from_mask.default: _plain(self.valid_len_from_mask),
                ops.key_start_from_mask.default: _plain(self.key_start_from_mask),
                ops.key_range_from_mask.default: _plain(self.key_range_from_mask)}

    def _op(self):
        from onnxscript.onnx_opset import opset23, opset24

        return opset24 if self.opset >= 24 else opset23

    def _attnopt_op(self, name: str):
        from onnxscript.values import Op, Opset

        from .onnx_functions import DOMAIN, DOMAIN_VERSION, op_schema

        self.functions.add(name)
        return Op(Opset(DOMAIN, DOMAIN_VERSION), name, op_schema(name))

    def decode_attention(self, q, k, v, attn_mask=None, valid_len=None, scale=1.0, is_causal=False, plan="", site="",
                         softcap=0.0, key_start=None, alibi_slopes=None):
        attn_mask = self._fold_key_start(k, attn_mask, key_start)
        form, runs, note = self.resolve(plan, _static(k.shape[2]) if k.shape is not None else None)
        softcap = float(softcap or 0.0)
        form, why = self._variant_form(site, form, softcap, alibi_slopes is not None,
                                       q.dtype in (_ir_dtype("FLOAT16"), _ir_dtype("BFLOAT16")))
        note = "; ".join(x for x in (note, why) if x)
        variants = ", ".join(([f"softcap={softcap:g}"] if softcap else []) +
                             (["alibi in the mask"] if alibi_slopes is not None else []))
        note = "; ".join(x for x in (note, variants) if x)
        if form == "saap":
            from .export_saap import saap_attention

            bias, lengths = self._function_inputs(q, k, attn_mask, valid_len)
            return saap_attention(self, q, k, v, bias, lengths, float(scale), bool(is_causal), runs, site)
        if form == "function":
            self.exported[site] = _described("attnopt:decode_attention", "function body", note)
            bias, lengths = self._function_inputs(q, k, attn_mask, valid_len, alibi_slopes)
            return self._attnopt_op("decode_attention")(q, k, v, bias, lengths, scale=float(scale),
                                                        is_causal=int(bool(is_causal)), softcap=softcap, plan=plan,
                                                        site=site)
        op = self._op()
        nonpad = None
        if valid_len is None and attn_mask is not None and attn_mask.dtype == _ir_bool() and self.opset >= 24:
            # A dense plan carries no valid length (attnopt's SDPA does not need one), but onnxruntime can stop at
            # the last visible key: derive it from the mask, exact for any mask (every later key is masked).
            valid_len = self.valid_len_from_mask(attn_mask, op.Shape(q, start=0, end=1))
        if valid_len is not None and self.opset >= 24 and not is_causal:
            nonpad = op.Cast(valid_len, to=_ONNX_INT64)
        elif valid_len is not None:
            attn_mask = self._fold_valid_len(k, attn_mask, valid_len)
        if alibi_slopes is not None:
            attn_mask = self._add_alibi(k, attn_mask, alibi_slopes, like=q)
        if attn_mask is not None:
            attn_mask = self._mask_rows(q, attn_mask)
        # attnopt caps the scaled scores s as c * tanh(s), its scale carrying the 1 / c; Attention computes
        # c * tanh(s' / c) with s' = QK^T * its scale, so its scale is attnopt's times c (the model's own scale)
        attrs = dict(scale=float(scale) * softcap if softcap else float(scale), is_causal=int(bool(is_causal)))
        if softcap:
            attrs["softcap"] = softcap
        if self.opset >= 24:
            y, _, _, _ = op.Attention(q, k, v, attn_mask, None, None, nonpad, **attrs)
        else:
            y, _, _, _ = op.Attention(q, k, v, attn_mask, **attrs)
        self.exported[site] = _described(f"onnx:Attention-{self.opset}", "nonpad_kv_seqlen" if nonpad is not None else "",
                                         note)
        return y

    def decode_attention_states(self, q, k, v, attn_mask=None, valid_len=None, scale=1.0, is_causal=False, plan="",
                                site="", softcap=0.0, key_start=None, alibi_slopes=None):
        _, _, note = self.resolve(plan, _static(k.shape[2]) if k.shape is not None else None, states=True)
        self.exported[site] = _described("attnopt:decode_attention_states", "function body", note)
        attn_mask = self._fold_key_start(k, attn_mask, key_start)
        bias, lengths = self._function_inputs(q, k, attn_mask, valid_len, alibi_slopes)
        return self._attnopt_op("decode_attention_states")(q, k, v, bias, lengths, scale=float(scale),
                                                           is_causal=int(bool(is_causal)),
                                                           softcap=float(softcap or 0.0), plan=plan, site=site)

    def merge_states(self, o_parts, lse_parts):
        return self._attnopt_op("merge_states")(o_parts, lse_parts)

    def valid_len_from_mask(self, attn_mask, batch):
        """One past the last visible key of each batch row, (batch,) int32: ReduceMax over a masked 1..N.
        ``batch`` is an int, a scalar or a (1,) int64 tensor."""
        op = self._op()
        visible = attn_mask if attn_mask.dtype == _ir_bool() else op.Not(op.IsInf(attn_mask, detect_positive=0))
        n = op.Shape(attn_mask, start=-1)
        rows = op.Concat(op.Shape(attn_mask, start=0, end=1), op.Constant(value_ints=[-1]), n, axis=0)
        any_row = op.ReduceMax(op.Reshape(op.Cast(visible, to=6), rows), op.Constant(value_ints=[1]), keepdims=0)
        one = op.Constant(value_int=1)
        positions = op.Cast(op.Range(one, op.Add(op.Squeeze(n), one), one), to=6)
        last = op.ReduceMax(op.Mul(any_row, positions), op.Constant(value_ints=[-1]), keepdims=0)
        size = op.Constant(value_ints=[int(batch)]) if isinstance(batch, int) else op.Reshape(batch, op.Constant(value_ints=[1]))
        return op.Expand(last, size)

    def key_start_from_mask(self, attn_mask, batch):
        """The first visible key of each batch row (0 where none is), (batch,) int32: ArgMax (first index of the
        maximum) over the rows' visibility."""
        op = self._op()
        visible = attn_mask if attn_mask.dtype == _ir_bool() else op.Not(op.IsInf(attn_mask, detect_positive=0))
        rows = op.Concat(op.Shape(attn_mask, start=0, end=1), op.Constant(value_ints=[-1]),
                         op.Shape(attn_mask, start=-1), axis=0)
        any_row = op.ReduceMax(op.Reshape(op.Cast(visible, to=6), rows), op.Constant(value_ints=[1]), keepdims=0)
        first = op.Cast(op.ArgMax(any_row, axis=-1, keepdims=0, select_last_index=0), to=6)
        size = op.Constant(value_ints=[int(batch)]) if isinstance(batch, int) else op.Reshape(batch, op.Constant(value_ints=[1]))
        return op.Expand(first, size)

    def key_range_from_mask(self, attn_mask, batch):
        """(2, batch) int32: the key start (2**31 - 1 where no key is visible: an empty range) over the valid length,
        as ``reference.key_range_from_mask``."""
        op = self._op()
        end = self.valid_len_from_mask(attn_mask, batch)
        zero, empty = (op.Cast(op.Constant(value_int=x), to=6) for x in (0, 2**31 - 1))  # int32, as the ends
        start = op.Where(op.Greater(end, zero), self.key_start_from_mask(attn_mask, batch), empty)
        axis = op.Constant(value_ints=[0])
        return op.Concat(op.Unsqueeze(start, axis), op.Unsqueeze(end, axis), axis=0)

    # ----------------------------------------------------------------------------------------- helpers
    def _fold_key_start(self, k, attn_mask, key_start):
        """``attn_mask`` narrowed to the keys at or after ``key_start`` (B,), a window's first key: a band site's mask
        (``passes/window.py``) may no longer hide them, or be gone."""
        if key_start is None:
            return attn_mask
        op = self._op()
        return self._narrow(attn_mask, op.Not(self._keep(k, key_start)))

    def _fold_valid_len(self, k, attn_mask, valid_len):
        """``attn_mask`` narrowed to the keys below ``valid_len`` (B,): bool (B, 1, 1, N) when there is no mask."""
        return self._narrow(attn_mask, self._keep(k, valid_len))

    def _narrow(self, attn_mask, keep):
        """``attn_mask`` (or nothing) AND ``keep`` (bool), typed: the later steps read the dtype to pick the form."""
        op = self._op()
        if attn_mask is not None and attn_mask.dtype != _ir_bool():
            return op.Where(keep, attn_mask, op.CastLike(op.Constant(value_float=float("-inf")), attn_mask))
        out = keep if attn_mask is None else op.And(attn_mask, keep)
        out.dtype = _ir_bool()
        return out

    def _mask_rows(self, q, attn_mask):
        """``attn_mask`` with one row per query token: onnxruntime's Attention does not broadcast the mask's
        query dimension (a (B, 1, 1, N) mask fails with 2 query tokens)."""
        shape = attn_mask.shape
        if shape is not None and len(shape) >= 2 and q.shape is not None and shape[-2] == q.shape[2]:
            return attn_mask
        op = self._op()
        rank = len(shape) if shape is not None else 4
        target = op.Concat(op.Shape(attn_mask, start=0, end=rank - 2), op.Shape(q, start=2, end=3),
                           op.Shape(attn_mask, start=rank - 1), axis=0)
        return op.Expand(attn_mask, target)

    def _add_alibi(self, k, attn_mask, alibi_slopes, like=None):
        """``attn_mask`` plus ALiBi's ``slope[h] * j`` for key j (``runtime/reference.py``), as an additive mask:
        (1, Hq, 1, N), broadcast with the mask (a boolean one becomes 0 / -inf first); fp32, or ``like``'s type
        (the standard node's mask has Q's)."""
        op = self._op()
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        cols = op.Cast(op.Range(zero, op.Squeeze(op.Shape(k, start=2, end=3)), one), to=_ONNX_FLOAT)
        slopes = op.Unsqueeze(op.Cast(alibi_slopes, to=_ONNX_FLOAT), op.Constant(value_ints=[-1]))
        bias = op.Unsqueeze(op.Mul(slopes, cols), op.Constant(value_ints=[0, 2]))
        if attn_mask is not None and attn_mask.dtype == _ir_bool():
            bias = op.Add(op.Where(attn_mask, op.Constant(value_float=0.0), op.Constant(value_float=float("-inf"))),
                          bias)
        elif attn_mask is not None:
            bias = op.Add(op.Cast(attn_mask, to=_ONNX_FLOAT), bias)
        return bias if like is None else op.CastLike(bias, like)

    def _keep(self, k, valid_len):
        op = self._op()
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        cols = op.Range(zero, op.Squeeze(op.Shape(k, start=2, end=3)), one)
        lengths = op.Unsqueeze(op.Cast(valid_len, to=_ONNX_INT64), op.Constant(value_ints=[-1]))
        return op.Unsqueeze(op.Less(cols, lengths), op.Constant(value_ints=[1, 2]))

    def _function_inputs(self, q, k, attn_mask, valid_len, alibi_slopes=None):
        """(bias, valid_len) as the function's fixed signature takes them: an additive float mask (a scalar 0 when
        there is none; ALiBi's bias added) and (B,) int64 lengths (N for every row when there are none)."""
        op = self._op()
        if alibi_slopes is not None:
            bias = self._add_alibi(k, attn_mask, alibi_slopes)
        elif attn_mask is None:
            bias = op.Constant(value_float=0.0)
        elif attn_mask.dtype == _ir_bool():
            bias = op.Where(attn_mask, op.Constant(value_float=0.0), op.Constant(value_float=float("-inf")))
        else:
            bias = attn_mask
        if valid_len is None:
            lengths = op.Expand(op.Shape(k, start=2, end=3), op.Shape(q, start=0, end=1))
        else:
            lengths = op.Cast(valid_len, to=_ONNX_INT64)
        return bias, lengths

    def add_functions(self, model) -> None:
        """Append the function bodies this export used to ``model`` (an ``onnx_ir.Model``) and import the domain."""
        import onnx_ir as ir

        from .onnx_functions import DOMAIN, DOMAIN_VERSION, function_proto

        if not self.functions:
            return
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
        for name in sorted(self.functions):
            fn = ir.serde.deserialize_function(function_proto(name, self.opset))
            model.functions[fn.identifier()] = fn
        if any(name.startswith("saap_") for name in self.functions):
            from .export_saap import add_cluster_inputs

            add_cluster_inputs(model)


def _plain(method: Callable) -> Callable:
    @functools.wraps(method)
    def translation(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return translation


def _described(form: str, *notes: str) -> str:
    """``form (note; note)``, or ``form`` when no note is set: a site's ``exported_as``."""
    shown = [n for n in notes if n]
    return f"{form} ({'; '.join(shown)})" if shown else form


def _static(dim: Any) -> int | None:
    """A tensor dimension as an int, or None when it is symbolic (a ``torch.SymInt`` or an ONNX symbolic dim)."""
    return dim if isinstance(dim, int) else None


def _ir_bool():
    return _ir_dtype("BOOL")


def _ir_dtype(name: str):
    import onnx_ir as ir

    return getattr(ir.DataType, name)


__all__ = ["OnnxTranslator", "OPSETS", "ATTENTION_FORMS", "STANDARD_KINDS", "SINGLE_DEVICE_KINDS", "FUNCTION_KINDS",
           "RESOLVED_KINDS", "EXPORTABLE_KINDS"]
