"""Where the planner's pick is SDPA itself (a dense plan: cuDNN on Hopper), the lowered graph runs nothing beside it:
the inner backend gets the decode op on the function's own inputs (no copy, no contiguous(), no expand, no mask or
valid-length work), as the planner bench's user function calls it, for a fixed, a growing and a static (masked)
cache. On the H100 the pick lost 0.35-0.85 µs to SDPA's own cuDNN call (RESULTS 0 of session 15) with the same
kernels; this test says the graph is not where."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnopt


def _attend(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("cache", ["fixed", "dynamic", "static"])
def test_a_dense_pick_is_the_op_alone_on_the_inputs(cache, inner_compiles):
    torch._dynamo.reset()
    B, Hq, Hkv, N, D = 1, 8, 2, 96, 64
    q, k, v = torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    args = (q, k, v)
    if cache == "static":
        args += ((torch.arange(N) < 40)[None, None, None, :].expand(B, 1, 1, N).contiguous(),)
    if cache == "dynamic":
        torch._dynamo.mark_dynamic(k, 2)
        torch._dynamo.mark_dynamic(v, 2)
    opt = attnopt.optimize(_attend, inner_backend="eager", force_plan="dense")
    out = opt(*args)
    torch.testing.assert_close(out, _attend(*args))
    (compiled,) = inner_compiles
    gm = compiled.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    ops = [n for n in calls if n.target is torch.ops.attnopt.decode_attention.default]
    assert len(ops) == 1 and ops[0].args[8] is not None, gm.graph
    # the symbolic length's sizes are host integers; any other node would be work beside SDPA
    others = [n for n in calls if n is not ops[0] and "sym_size" not in str(n.target)]
    assert not others, f"ops beside the dense pick: {[str(n.target) for n in others]}"
    tensors = [n for n in placeholders if isinstance(n.meta.get("example_value"), torch.Tensor)]
    assert list(ops[0].args[:3]) == tensors[:3], "q, k, v reach the op as the function's own inputs"
    assert ops[0].args[3] is (tensors[3] if cache == "static" else None) and ops[0].args[4] is None
    assert '"kind": "dense"' in ops[0].args[7]
