"""One file per plan kind; importing this package registers them all."""
from .base import STRATEGIES, PlanContext, Strategy, get_strategy, register_strategy
from . import dense  # noqa: F401  (registers DensePlan)
from . import split_kv  # noqa: F401  (registers SplitKVPlan)
from . import stream_k  # noqa: F401  (registers StreamKPlan)
from . import tree  # noqa: F401  (registers TreePlan)
from . import ring  # noqa: F401  (registers RingPlan)
from . import bucketed  # noqa: F401  (registers BucketedPlan)
from . import saap  # noqa: F401  (registers SaapPlan)
from . import cascade  # noqa: F401  (registers CascadePlan)

__all__ = ["STRATEGIES", "PlanContext", "Strategy", "get_strategy", "register_strategy"]
