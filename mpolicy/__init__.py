"""mpolicy: mixed precision for JAX and Haiku.

Policies and loss scaling with jmp's API, one registry of policies by module
class or name pattern, `transform_amp` for Haiku, and an op-level interpreter
(`amp`) that runs each primitive in the dtype its rule gives it.
"""

from mpolicy._src.policy import cast_to_full
from mpolicy._src.policy import cast_to_half
from mpolicy._src.policy import get_policy
from mpolicy._src.policy import half_dtype
from mpolicy._src.policy import Policy

from mpolicy._src.loss_scale import all_finite
from mpolicy._src.loss_scale import DynamicLossScale
from mpolicy._src.loss_scale import LossScale
from mpolicy._src.loss_scale import NoOpLossScale
from mpolicy._src.loss_scale import select_tree
from mpolicy._src.loss_scale import StaticLossScale

from mpolicy._src.registry import clear_policies
from mpolicy._src.registry import clear_policy
from mpolicy._src.registry import explain_policy
from mpolicy._src.registry import PolicyExplanation
from mpolicy._src.registry import policy_for
from mpolicy._src.registry import push_policy
from mpolicy._src.registry import set_policy

from mpolicy._src.haiku_bridge import current_policy
from mpolicy._src.haiku_bridge import transform_amp
from mpolicy._src.haiku_bridge import transform_amp_with_state
from mpolicy._src.haiku_bridge import with_policies

__version__ = "0.1.0"

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "PolicyExplanation",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "clear_policies",
    "clear_policy",
    "current_policy",
    "explain_policy",
    "get_policy",
    "half_dtype",
    "policy_for",
    "push_policy",
    "select_tree",
    "set_policy",
    "transform_amp",
    "transform_amp_with_state",
    "with_policies",
)
