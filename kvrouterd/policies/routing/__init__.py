"""Routing policies: ``POLICIES`` lists every one by the name configs and the registry use.

``kvrouterd/policies/__init__.py`` hands this list to the registry; a policy module does not
register itself. A new policy is one module here and one line below.
"""

from __future__ import annotations

from ..base import NoParams
from ..latency import LatencyParams
from .cache_affinity import CacheAffinityParams, CacheAffinityPolicy
from .cache_aware import CacheAwareParams, CacheAwarePolicy
from .compose import ComposeParams, ComposePolicy
from .dualmap import DualMapPaperParams, DualMapPaperPolicy, DualMapParams, DualMapPolicy
from .dynamo import DynamoParams, DynamoPolicy
from .kv_cost import KVCostParams, KVCostPolicy
from .lbgr import LBGRParams, LBGRPolicy
from .least_loaded import LeastLoadedPolicy
from .llm_d import LlmDParams, LlmDPolicy
from .min_ttft import MinTTFTPolicy
from .preble import PrebleParams, PreblePolicy
from .random import RandomPolicy
from .round_robin import RoundRobinPolicy

__all__ = ["POLICIES"]

#: (name, policy class, Params dataclass), one per routing policy
POLICIES: tuple[tuple[str, type, type], ...] = (
    ("cache_affinity", CacheAffinityPolicy, CacheAffinityParams),
    ("cache_aware", CacheAwarePolicy, CacheAwareParams),
    ("compose", ComposePolicy, ComposeParams),
    ("dualmap", DualMapPolicy, DualMapParams),
    ("dualmap_paper", DualMapPaperPolicy, DualMapPaperParams),
    ("dynamo", DynamoPolicy, DynamoParams),
    ("kv_cost", KVCostPolicy, KVCostParams),
    ("lbgr", LBGRPolicy, LBGRParams),
    ("least_loaded", LeastLoadedPolicy, NoParams),
    ("llm_d", LlmDPolicy, LlmDParams),
    ("min_ttft", MinTTFTPolicy, LatencyParams),
    ("preble", PreblePolicy, PrebleParams),
    ("random", RandomPolicy, NoParams),
    ("round_robin", RoundRobinPolicy, NoParams),
)
