"""attnopt: find decode-time attention in PyTorch models and run it with the fastest exact plan.

>>> model = attnopt.optimize(model)          # or torch.compile(model, backend="attnopt")
>>> model.generate(...)
>>> print(attnopt.last_plans(model).format_table())
"""
from .api import last_plans, optimize
from .backend import Backend
from .config import OptimizeConfig
from .export import export_onnx
from .plan import DensePlan, Plan, RingPlan, SaapPlan, SplitKVPlan, StreamKPlan, TreePlan, plan_from_json
from .report import PlanReport, SiteReport
from .site import AttentionSite

__version__ = "0.1.0"



def __getattr__(name: str):
    if name == "SharedPrefixCache":  # imports transformers: only when asked for
        from .shared_prefix import SharedPrefixCache

        return SharedPrefixCache
    raise AttributeError(f"module 'attnopt' has no attribute {name!r}")


__all__ = ["optimize", "SharedPrefixCache", "last_plans", "export_onnx", "Backend", "OptimizeConfig", "AttentionSite", "Plan", "PlanReport",
           "SiteReport", "DensePlan", "SplitKVPlan", "StreamKPlan", "TreePlan", "RingPlan", "SaapPlan",
           "plan_from_json"]
