"""Bench helpers that need no GPU: the rotating call and the plan call the kernel bench and its experiments time."""
import math

import torch

from attnopt.bench.common import cycle
from attnopt.bench.kernels import plan_call
from attnopt.plan import SplitKVPlan, StreamKPlan
from attnopt.runtime.reference import sdpa_float64


def test_cycle_runs_the_calls_in_turn_from_the_first():
    seen = []
    fn = cycle([lambda i=i: seen.append(i) or i for i in range(3)])
    assert [fn() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_plan_call_runs_the_plan_on_the_set_with_its_valid_lengths():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 64, generator=g)
    k = torch.randn(2, 2, 50, 64, generator=g)
    v = torch.randn(2, 2, 50, 64, generator=g)
    valid = torch.tensor([50, 17], dtype=torch.int32)
    scale = 1 / math.sqrt(64)
    for s in ({"q": q, "k": k, "v": v, "valid": None}, {"q": q, "k": k, "v": v, "valid": valid}):
        ref = sdpa_float64(q, k, v, valid_len=s["valid"], scale=scale)
        for plan in (SplitKVPlan(num_splits=3, block_n=16), StreamKPlan(grid=5, block_n=16)):
            out = plan_call(plan, s, scale)()
            assert (out.double() - ref).abs().max().item() < 1e-5, (plan.describe(), s["valid"])
