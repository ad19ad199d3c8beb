"""vLLM rollout servers as Ray actors, the pool that routes requests to them, and the
worker extension that receives trainer weights (see docs/rollout.md).

Importing this package imports neither vLLM nor torch; the servers import vLLM when
they start.
"""

from polyrl.rollout.pool import PROMPT_KEY, RolloutPool, apply_overlong_policy
from polyrl.rollout.sampling import RolloutConfig, SamplingSpec, derive_seed
from polyrl.rollout.server import RolloutServer, StaleWeightsError

__all__ = [
    "PROMPT_KEY",
    "RolloutConfig",
    "RolloutPool",
    "RolloutServer",
    "SamplingSpec",
    "StaleWeightsError",
    "apply_overlong_policy",
    "derive_seed",
]
