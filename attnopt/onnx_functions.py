"""ONNX function bodies of attnopt's ops, for the ``attnopt`` domain nodes that ``attnopt.export`` writes.

A runtime that has no kernel for ``attnopt::decode_attention`` (any ONNX runtime) runs the node through its
body: exact attention in float32 over the un-expanded K/V, with the semantics of ``runtime/reference.py``
(GQA packs the G query heads of one KV head; keys at or past ``valid_len[b]`` do not exist; ``is_causal`` is
PyTorch's top-left alignment; a row that sees no key gives zeros and ``lse = -inf``, never NaN).

The node's inputs are fixed so that one function serves every call:

* ``q`` (B, Hq, L, D), ``k`` (B, Hkv, N, D), ``v`` (B, Hkv, N, Dv), any float type;
* ``bias``: an additive float mask broadcastable to (B, Hq, L, N) (a boolean mask becomes 0 / -inf before the
  node; no mask is a scalar 0);
* ``valid_len`` (B,) int64 (no valid length is N for every row).

Attributes: ``scale`` (float), ``is_causal`` (int), ``softcap`` (float: c != 0 caps the scaled scores to
``c * tanh(s)`` before the bias, as ``runtime/reference.py`` does; ALiBi comes folded into ``bias``), and
``plan`` / ``site`` (strings the body ignores: they tell a runtime with attnopt's kernels which plan attnopt
chose for the site).
"""
from __future__ import annotations

#: The domain of attnopt's ONNX nodes and its version.
DOMAIN = "attnopt"
DOMAIN_VERSION = 1

_HEADER = '<domain: "attnopt", opset_import: ["" : {opset}]>\n'

# Shared by decode_attention and decode_attention_states: scores in the packed (B, Hkv, G*L, N) layout, masked
# in the (B, Hq, L, N) layout, then the softmax state. "bad" marks keys a row must not see; -inf biases count too,
# so a row whose every key is masked has p = 0 everywhere and no -inf - -inf = NaN.
_SHAPES = """
    qf = Cast <to = 1> (q)
    kf = Cast <to = 1> (k)
    vf = Cast <to = 1> (v)
    batch = Shape <start = 0, end = 1> (q)
    q_heads = Shape <start = 1, end = 2> (q)
    q_len = Shape <start = 2, end = 3> (q)
    head_dim = Shape <start = 3, end = 4> (q)
    kv_heads = Shape <start = 1, end = 2> (k)
    kv_len = Shape <start = 2, end = 3> (k)
    v_dim = Shape <start = 3, end = 4> (v)
    group = Div (q_heads, kv_heads)
    packed_rows = Mul (group, q_len)
    packed_q_shape = Concat <axis = 0> (batch, kv_heads, packed_rows, head_dim)
    packed_s_shape = Concat <axis = 0> (batch, kv_heads, packed_rows, kv_len)
    full_s_shape = Concat <axis = 0> (batch, q_heads, q_len, kv_len)
    out_shape = Concat <axis = 0> (batch, q_heads, q_len, v_dim)
    zero_i = Constant <value_int = 0> ()
    one_i = Constant <value_int = 1> ()
    last_axis = Constant <value_ints = [-1]> ()
    mid_axes = Constant <value_ints = [1, 2]> ()
    n_scalar = Squeeze (kv_len)
    l_scalar = Squeeze (q_len)
    cols = Range (zero_i, n_scalar, one_i)
"""
_ATTENTION = """
    bf = Cast <to = 1> (bias)
    q_packed = Reshape (qf, packed_q_shape)
    k_t = Transpose <perm = [0, 1, 3, 2]> (kf)
    raw = MatMul (q_packed, k_t)
    scale_value = Constant <value_float: float = @scale> ()
    scaled = Mul (raw, scale_value)
    scores_full = Reshape (capped, full_s_shape)
    scores = Add (scores_full, bf)
    rows = Range (zero_i, l_scalar, one_i)
    valid_col = Unsqueeze (valid_len, last_axis)
    past_valid = GreaterOrEqual (cols, valid_col)
    past_valid4 = Unsqueeze (past_valid, mid_axes)
    rows_col = Unsqueeze (rows, last_axis)
    above = Greater (cols, rows_col)
    causal_int = Constant <value_int: int = @is_causal> ()
    causal_flag = Cast <to = 9> (causal_int)
    causal_bad = And (above, causal_flag)
    masked_out = IsInf <detect_positive = 0> (scores)
    bad_a = Or (past_valid4, causal_bad)
    bad = Or (bad_a, masked_out)
    lowest = Constant <value = float {-3.4028234663852886e38}> ()
    zero_f = Constant <value = float {0.0}> ()
    one_f = Constant <value = float {1.0}> ()
    kept = Where (bad, lowest, scores)
    row_max = ReduceMax <keepdims = 1> (kept, last_axis)
    shifted = Sub (kept, row_max)
    expd = Exp (shifted)
    p = Where (bad, zero_f, expd)
    denom = ReduceSum <keepdims = 1> (p, last_axis)
    empty = Equal (denom, zero_f)
    safe_denom = Where (empty, one_f, denom)
    p_packed = Reshape (p, packed_s_shape)
    o_packed = MatMul (p_packed, vf)
    o_full = Reshape (o_packed, out_shape)
    o_norm = Div (o_full, safe_denom)
"""
# ``softcap`` c != 0 caps the scaled scores to c * tanh(s) before the bias (``runtime/reference.py``); 0 keeps them.
_CAP = """
    cap_value = Constant <value_float: float = @softcap> ()
    cap_zero = Constant <value = float {0.0}> ()
    no_cap = Equal (cap_value, cap_zero)
    tanh_scores = Tanh (scaled)
    capped_scores = Mul (tanh_scores, cap_value)
    capped = Where (no_cap, scaled, capped_scores)
"""
_NO_CAP = """
    capped = Identity (scaled)
"""
_SCORES_END = "    scaled = Mul (raw, scale_value)\n"


def _with(cap: str, body: str) -> str:
    """``body`` (ending in ``_ATTENTION``) with ``cap`` right after the scaled scores."""
    return body.replace(_SCORES_END, _SCORES_END + cap.lstrip("\n"), 1)


_ATTENTION_BODY = _with(_CAP, _SHAPES + _ATTENTION)


_DECODE_ATTENTION = (_HEADER + "decode_attention <scale: float = 1.0, is_causal: int = 0, softcap: float = 0.0, "
                     "plan: string = \"\", site: string = \"\"> (q, k, v, bias, valid_len) => (out) {"
                     + _ATTENTION_BODY + """
    out = CastLike (o_norm, q)
}
""")

_DECODE_ATTENTION_STATES = (_HEADER + "decode_attention_states <scale: float = 1.0, is_causal: int = 0, "
                            "softcap: float = 0.0, plan: string = \"\", site: string = \"\"> (q, k, v, bias, valid_len) => (o, lse) {"
                            + _ATTENTION_BODY + """
    o = Identity (o_norm)
    neg_inf = Constant <value = float {-inf}> ()
    log_denom = Log (safe_denom)
    lse_finite = Add (row_max, log_denom)
    lse_keep = Where (empty, neg_inf, lse_finite)
    lse = Squeeze (lse_keep, last_axis)
}
""")

# (P, ..., Dv) and (P, ...) float32 partial states -> merged (..., Dv), (...); empty partitions (lse = -inf) weigh 0.
_MERGE_STATES = _HEADER + """merge_states (o_parts, lse_parts) => (o, lse) {
    first_axis = Constant <value_ints = [0]> ()
    last_axis = Constant <value_ints = [-1]> ()
    zero_f = Constant <value = float {0.0}> ()
    one_f = Constant <value = float {1.0}> ()
    neg_inf = Constant <value = float {-inf}> ()
    lse_max = ReduceMax <keepdims = 0> (lse_parts, first_axis)
    all_empty = IsInf <detect_positive = 0> (lse_max)
    safe_max = Where (all_empty, zero_f, lse_max)
    safe_max0 = Unsqueeze (safe_max, first_axis)
    shifted = Sub (lse_parts, safe_max0)
    weight = Exp (shifted)
    total = ReduceSum <keepdims = 0> (weight, first_axis)
    safe_total = Where (all_empty, one_f, total)
    weight_col = Unsqueeze (weight, last_axis)
    weighted = Mul (o_parts, weight_col)
    summed = ReduceSum <keepdims = 0> (weighted, first_axis)
    total_col = Unsqueeze (safe_total, last_axis)
    o = Div (summed, total_col)
    log_total = Log (safe_total)
    lse_finite = Add (safe_max, log_total)
    lse = Where (all_empty, neg_inf, lse_finite)
}
"""

# SAAP (``runtime/saap/decode.py``): de-rope the queries at their positions, score the clusters per KV head (the
# group's and the call's tokens summed), take the top ``probes``, and keep the sink, the window (``clusters`` < 0)
# and the keys of the chosen clusters, then the exact attention over the kept keys. It shares the attention body's
# shapes (``_SHAPES``); the prefix "s_" keeps its own names apart.
_SAAP_DEROPE = """
    s_ax1 = Constant <value_ints = [1]> ()
    s_ax2 = Constant <value_ints = [2]> ()
    s_ax13 = Constant <value_ints = [1, 3]> ()
    s_kv_len = Min (valid_len, kv_len)
    s_steps = Range (zero_i, l_scalar, one_i)
    s_kv_col = Unsqueeze (s_kv_len, last_axis)
    s_start = Sub (s_kv_col, q_len)
    s_pos = Add (s_start, s_steps)
    s_posf = Cast <to = 1> (s_pos)
    s_pos4 = Unsqueeze (s_posf, s_ax13)
    s_freqs = Mul (s_pos4, inv_freq)
    s_emb = Concat <axis = -1> (s_freqs, s_freqs)
    s_cos = Cos (s_emb)
    s_sin = Sin (s_emb)
    s_x1, s_x2 = Split <axis = -1, num_outputs = 2> (qf)
    s_nx2 = Neg (s_x2)
    s_rot = Concat <axis = -1> (s_nx2, s_x1)
    s_qc = Mul (qf, s_cos)
    s_rs = Mul (s_rot, s_sin)
    s_qd = Sub (s_qc, s_rs)
    s_qpk = Reshape (s_qd, packed_q_shape)
"""
_SAAP_SCORE_CENTROIDS = """
    s_ct = Transpose <perm = [0, 2, 1]> (centroids)
    s_raw = MatMul (s_qpk, s_ct)
    s_scale = Constant <value_float: float = @scale> ()
    s_logits = Mul (s_raw, s_scale)
"""
# The query MLP as the rule scores with it (``runtime/kernels/saap_rule.py``'s ``mlp_logits``): the BatchNorm folded
# into w1 and b1, the weights bf16 values (given as fp32), each layer's input rounded to bf16 (Cast: nearest even),
# the products and sums fp32: Linear -> ReLU -> Linear.
_SAAP_SCORE_MLP = """
    s_x16 = Cast <to = 16> (s_qpk)
    s_x = Cast <to = 1> (s_x16)
    s_w1t = Transpose <perm = [0, 2, 1]> (w1)
    s_h0 = MatMul (s_x, s_w1t)
    s_b1 = Unsqueeze (b1, s_ax1)
    s_h1 = Add (s_h0, s_b1)
    s_h2 = Relu (s_h1)
    s_h16 = Cast <to = 16> (s_h2)
    s_h = Cast <to = 1> (s_h16)
    s_w2t = Transpose <perm = [0, 2, 1]> (w2)
    s_o2 = MatMul (s_h, s_w2t)
    s_b2 = Unsqueeze (b2, s_ax1)
    s_logits = Add (s_o2, s_b2)
"""
# The selection rule (``runtime/kernels/saap_rule.py``'s ``top_clusters``): the group scores (softmax sums, >= 0) cut to
# bf16's 8 significant bits, toward zero (the kernel ranks the top 16 bits of each float's key), as fp32 values:
# floor(x * 2^(7 - e)) * 2^(e - 7) in float64 with e = floor(log2 x), at least -126 (fp32's subnormals: the cut keeps
# multiples of 2^-133), taken from Log and corrected by one either way against exact powers of two. TopK then
# breaks ties by the lowest index, as ONNX specifies and the rule does.
_SAAP_CUT = """
    c_x = Cast <to = 11> (s_scores)
    c_ln2 = Constant <value = double {0.6931471805599453}> ()
    c_two = Constant <value = double {2.0}> ()
    c_one = Constant <value = double {1.0}> ()
    c_seven = Constant <value = double {7.0}> ()
    c_emin = Constant <value = double {-126.0}> ()
    c_log = Log (c_x)
    c_log2 = Div (c_log, c_ln2)
    c_e0 = Floor (c_log2)
    c_e1 = Max (c_e0, c_emin)
    c_p1 = Pow (c_two, c_e1)
    c_over = Greater (c_p1, c_x)
    c_over_d = Cast <to = 11> (c_over)
    c_e2 = Sub (c_e1, c_over_d)
    c_e3 = Max (c_e2, c_emin)
    c_e3_next = Add (c_e3, c_one)
    c_p3 = Pow (c_two, c_e3_next)
    c_under = LessOrEqual (c_p3, c_x)
    c_under_d = Cast <to = 11> (c_under)
    c_e = Add (c_e3, c_under_d)
    c_up = Sub (c_seven, c_e)
    c_scale_up = Pow (c_two, c_up)
    c_scaled = Mul (c_x, c_scale_up)
    c_mant = Floor (c_scaled)
    c_down = Neg (c_up)
    c_scale_down = Pow (c_two, c_down)
    c_cut = Mul (c_mant, c_scale_down)
    s_rank = Cast <to = 1> (c_cut)
"""
_SAAP_SELECT = """
    s_probs = Softmax <axis = -1> (s_logits)
    s_scores = ReduceSum <keepdims = 0> (s_probs, s_ax2)
""" + _SAAP_CUT + """
    s_c = Shape <start = -1> (s_scores)
    s_probes0 = Constant <value_int: int = @probes> ()
    s_probes = Reshape (s_probes0, last_axis)
    s_topk = Min (s_probes, s_c)
    s_top_values, s_top = TopK <axis = -1, largest = 1, sorted = 1> (s_rank, s_topk)
    s_zero_f = Constant <value = float {0.0}> ()
    s_one_f = Constant <value = float {1.0}> ()
    s_none = Mul (s_scores, s_zero_f)
    s_top_zero = Mul (s_top_values, s_zero_f)
    s_top_one = Add (s_top_zero, s_one_f)
    s_chosen = ScatterElements <axis = 2> (s_none, s_top, s_top_one)
    s_owner = Max (clusters, zero_i)
    s_picked = GatherElements <axis = 2> (s_chosen, s_owner)
    s_picked_b = Cast <to = 9> (s_picked)
    s_always = Less (clusters, zero_i)
    s_keep3 = Or (s_always, s_picked_b)
    s_row0 = Sub (n_scalar, l_scalar)
    s_rows = Range (s_row0, n_scalar, one_i)
    s_rows_col = Unsqueeze (s_rows, last_axis)
    s_causal = LessOrEqual (cols, s_rows_col)
    s_keep3u = Unsqueeze (s_keep3, s_ax2)
    s_keep4 = And (s_keep3u, s_causal)
    s_keep5 = Unsqueeze (s_keep4, s_ax2)
    s_ex_shape = Concat <axis = 0> (batch, kv_heads, group, q_len, kv_len)
    s_keep6 = Expand (s_keep5, s_ex_shape)
    s_keep = Reshape (s_keep6, full_s_shape)
    s_user_bias = Cast <to = 1> (user_bias)
    s_neg_inf = Constant <value = float {-inf}> ()
    bias = Where (s_keep, s_user_bias, s_neg_inf)
"""
_SAAP_ATTRS = "scale: float = 1.0, is_causal: int = 0, probes: int = 1, plan: string = \"\", site: string = \"\""
_SAAP_INPUTS = "q, k, v, user_bias, valid_len, clusters, inv_freq"
_SAAP_OUT = """
    out = CastLike (o_norm, q)
}
"""
_SAAP_DECODE_ATTENTION = (_HEADER + f"saap_decode_attention <{_SAAP_ATTRS}> ({_SAAP_INPUTS}, centroids) => (out) {{"
                          + _with(_NO_CAP, _SHAPES + _SAAP_DEROPE + _SAAP_SCORE_CENTROIDS + _SAAP_SELECT + _ATTENTION)
                          + _SAAP_OUT)
_SAAP_DECODE_ATTENTION_MLP = (_HEADER + f"saap_decode_attention_mlp <{_SAAP_ATTRS}> "
                              f"({_SAAP_INPUTS}, w1, b1, w2, b2) => (out) {{"
                              + _with(_NO_CAP, _SHAPES + _SAAP_DEROPE + _SAAP_SCORE_MLP + _SAAP_SELECT + _ATTENTION)
                              + _SAAP_OUT)
#: The inputs after (q, k, v, bias, valid_len) of the SAAP functions: the clusters of each key (an input of the
#: graph), the RoPE's inverse frequencies and the index's tensors (initializers).
SAAP_INDEX_INPUTS = {"saap_decode_attention": ("centroids",),
                     "saap_decode_attention_mlp": ("w1", "b1", "w2", "b2")}

_TEXTS = {"decode_attention": _DECODE_ATTENTION, "decode_attention_states": _DECODE_ATTENTION_STATES,
          "merge_states": _MERGE_STATES, "saap_decode_attention": _SAAP_DECODE_ATTENTION,
          "saap_decode_attention_mlp": _SAAP_DECODE_ATTENTION_MLP}


def function_proto(name: str, opset: int):
    """The ``onnx.FunctionProto`` of attnopt op ``name`` (a key of ``_TEXTS``), importing the default domain at
    ``opset`` (the model's: runtimes want one version per domain)."""
    import onnx.parser

    try:
        text = _TEXTS[name]
    except KeyError:
        raise ValueError(f"no ONNX function body for attnopt op {name!r}; known: {', '.join(sorted(_TEXTS))}") from None
    if name in SAAP_INDEX_INPUTS:
        text = text.replace(_SAAP_CUT, _saap_cut())
    return onnx.parser.parse_function(text.replace("{opset}", str(int(opset)), 1))


def _saap_cut() -> str:
    """The SAAP selection's ranking for the rule's key width (``runtime/kernels/saap_rule.py``'s ``SELECT_KEY_BITS``): the
    scores cut to 16 bits, or as they are for 32 (the order of non-negative floats is their keys')."""
    from attnopt.runtime.kernels.saap_rule import SELECT_KEY_BITS

    if SELECT_KEY_BITS not in (16, 32):
        raise ValueError(f"the SAAP ONNX node ranks 16- or 32-bit score keys; SELECT_KEY_BITS is {SELECT_KEY_BITS}")
    return _SAAP_CUT if SELECT_KEY_BITS == 16 else "    s_rank = Identity (s_scores)\n"


def op_schema(name: str):
    """An ``onnx.defs.OpSchema`` for the ``attnopt`` domain node ``name``, so that onnxscript can record it while
    the exporter traces (the schema is not registered globally; the function body is what runtimes read)."""
    from onnx.defs import OpSchema

    def param(n: str, t: str) -> OpSchema.FormalParameter:
        return OpSchema.FormalParameter(n, t)

    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    if name == "merge_states":
        return OpSchema(name, DOMAIN, DOMAIN_VERSION, inputs=[param("o_parts", "F"), param("lse_parts", "F")],
                        outputs=[param("o", "F"), param("lse", "F")],
                        type_constraints=[("F", ["tensor(float)"], "float32 softmax states")])
    if name in SAAP_INDEX_INPUTS:
        attrs = [OpSchema.Attribute(n, t, d) for n, t, d in (
            ("scale", OpSchema.AttrType.FLOAT, "softmax scale (also the centroid scores')"),
            ("is_causal", OpSchema.AttrType.INT, "top-left causal mask"),
            ("probes", OpSchema.AttrType.INT, "clusters attended per KV head"),
            ("plan", OpSchema.AttrType.STRING, "the plan's runtime key (JSON)"),
            ("site", OpSchema.AttrType.STRING, "the site key"))]
        inputs = [param("q", "T"), param("k", "T"), param("v", "T"), param("user_bias", "M"), param("valid_len", "I"),
                  param("clusters", "I"), param("inv_freq", "F")] + [param(n, "F") for n in SAAP_INDEX_INPUTS[name]]
        return OpSchema(name, DOMAIN, DOMAIN_VERSION, inputs=inputs, outputs=[param("out", "T")], attributes=attrs,
                        type_constraints=[("T", floats, "Q/K/V"), ("M", floats, "additive mask"),
                                          ("I", ["tensor(int64)"], "valid length, clusters of the keys"),
                                          ("F", ["tensor(float)"], "the SAAP index")])
    if name not in ("decode_attention", "decode_attention_states"):
        raise ValueError(f"no ONNX schema for attnopt op {name!r}")
    attrs = [OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale"),
             OpSchema.Attribute("is_causal", OpSchema.AttrType.INT, "top-left causal mask"),
             OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, "c != 0 caps the scaled scores to c * tanh(s)"),
             OpSchema.Attribute("plan", OpSchema.AttrType.STRING, "the plan's runtime key (JSON)"),
             OpSchema.Attribute("site", OpSchema.AttrType.STRING, "the site key")]
    inputs = [param("q", "T"), param("k", "T"), param("v", "T"), param("bias", "M"), param("valid_len", "I")]
    outputs = [param("out", "T")] if name == "decode_attention" else [param("o", "F"), param("lse", "F")]
    constraints = [("T", floats, "Q/K/V"), ("M", floats, "additive mask"), ("I", ["tensor(int64)"], "valid length")]
    if name == "decode_attention_states":
        constraints.append(("F", ["tensor(float)"], "float32 softmax state"))
    return OpSchema(name, DOMAIN, DOMAIN_VERSION, inputs=inputs, outputs=outputs, type_constraints=constraints,
                    attributes=attrs)


__all__ = ["DOMAIN", "DOMAIN_VERSION", "SAAP_INDEX_INPUTS", "function_proto", "op_schema"]
