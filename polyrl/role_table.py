"""The role vocabulary: the :class:`Role` names and one table of what each role is.

Every module that needs to know which roles train, which carry a value head, which host
an engine or where a role's settings live asks :data:`ROLE_TABLE` (or the tuples derived
from it below) instead of listing role names again; :func:`role_names` says which roles
a run starts. ``polyrl.cluster.roles`` builds a run's roles (pools, workers, engines) from this
table and a RunConfig.

Imports nothing of polyrl: ``polyrl.config`` (ModelConfig, RunConfig), the backends and
``polyrl.cluster.roles`` all import it (docs/design.md "Who may import whom").
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "Role",
    "RoleFacts",
    "ROLE_TABLE",
    "DEFAULT_POOL",
    "ENGINE_ROLES",
    "TRAINED_ROLES",
    "VALUE_HEAD_ROLES",
    "SERVICE_ROLES",
    "role_names",
    "run_roles",
    "trained_roles",
    "reference_in_actor",
    "exported_role",
]

DEFAULT_POOL = "shared"  # the RunConfig.pools entry a role runs in unless told otherwise


class Role(enum.StrEnum):
    """A role's name: in the run's role table, gin scopes (``actor/polyrl.RoleConfig``),
    worker labels (timeline, ``--debug`` places), fault injection and checkpoints.
    Declared in the order a step's data flows through them (the timeline's track order)."""

    ROLLOUT = "rollout"
    ENV = "env"
    REWARD = "reward"
    REWARD_MODEL = "reward_model"
    JUDGE = "judge"
    REFERENCE = "reference"
    TEACHER = "teacher"
    ACTOR = "actor"
    CRITIC = "critic"
    SHADOW = "shadow"


@dataclasses.dataclass(frozen=True)
class RoleFacts:
    """What a role is, the same in every run.

    kind: ``"engine"`` (Ray workers hosting a TrainEngine, ``polyrl.cluster.workers``),
      ``"rollout"`` (vLLM servers, ``polyrl.rollout.pool``: the rollout's, an LLM judge's
      own), ``"reward"`` (rule-reward
      workers, ``polyrl.rewards.workers``) or ``"env"`` (environment workers,
      ``polyrl.envs.workers``).
    trained: the role has an optimizer (``RoleConfig.optim``); else it is frozen.
    value_head: the engine adds a scalar head on the last hidden state (critic values,
      reward-model scores) instead of scoring tokens.
    config: the RunConfig field that holds the role's own settings (an engine role's
      ``RoleConfig``; the rollout's ``RolloutConfig``; the judge's ``JudgeConfig``); None:
      the role has none of its own (reward and env workers: ``RunConfig.reward_workers``,
      ``RunConfig.episodes``).
    layout_of: a role whose settings this one takes when its own field is None.
    own_model: the role loads a checkpoint of its own (``RoleConfig.model_path``,
      ``JudgeConfig.model_path``), not ``RunConfig.model_path`` (the reward model, the
      distillation teacher, a judge of its own).
    other_backend: the role's engine runs on the backend the run does not train on.
    """

    kind: str
    trained: bool = False
    value_head: bool = False
    config: str | None = None
    layout_of: Role | None = None
    own_model: bool = False
    other_backend: bool = False


ROLE_TABLE: dict[Role, RoleFacts] = {
    Role.ROLLOUT: RoleFacts("rollout", config="rollout"),
    Role.ENV: RoleFacts("env"),
    Role.REWARD: RoleFacts("reward"),
    Role.REWARD_MODEL: RoleFacts("engine", value_head=True, config="reward_model", own_model=True),
    # An LLM judge's own vLLM servers (RunConfig.judge with JudgeConfig.model_path): frozen.
    Role.JUDGE: RoleFacts("rollout", config="judge", own_model=True),
    Role.REFERENCE: RoleFacts("engine", config="reference"),
    # On-policy distillation's frozen teacher: scores the student's sampled tokens.
    Role.TEACHER: RoleFacts("engine", config="teacher", own_model=True),
    Role.ACTOR: RoleFacts("engine", trained=True, config="actor"),
    Role.CRITIC: RoleFacts("engine", trained=True, value_head=True, config="critic"),
    # The shadow check's frozen scorer (polyrl.observe.shadow), laid out as the reference.
    Role.SHADOW: RoleFacts("engine", config="shadow", layout_of=Role.REFERENCE, other_backend=True),
}

ENGINE_ROLES = tuple(r for r, f in ROLE_TABLE.items() if f.kind == "engine")
# What a Tinker service (polyrl.service) starts: its training clients placed as the actor,
# its samplers on the rollout servers.
SERVICE_ROLES = (Role.ACTOR, Role.ROLLOUT)
TRAINED_ROLES = tuple(r for r, f in ROLE_TABLE.items() if f.trained)
VALUE_HEAD_ROLES = tuple(r for r, f in ROLE_TABLE.items() if f.value_head)


def reference_in_actor(cfg: Any, spec: Any) -> bool:
    """With LoRA (``RunConfig.lora``) the reference is the actor's own frozen base, scored
    with the adapters off: no reference role, no second copy of the weights."""
    return spec.needs_reference and cfg.lora is not None


def exported_role(spec: Any) -> Role:
    """The role whose weights a run exports (``RunConfig.export_final``, ``polyrl
    export``) and whose batch arithmetic validate-config prints: the actor, or a
    reward-model run's critic (the reward model it trains)."""
    return Role.ACTOR if spec.needs_actor else Role.CRITIC


def role_names(cfg: Any, spec: Any) -> list[Role]:
    """The placed roles this run starts, in start-up order."""
    rl = spec.objective == "rl"
    separate_reference = spec.needs_reference and not reference_in_actor(cfg, spec)
    starts = {
        Role.ACTOR: spec.needs_actor,
        Role.ROLLOUT: rl,
        Role.REFERENCE: separate_reference,
        Role.TEACHER: rl and spec.needs_teacher,
        Role.CRITIC: spec.needs_critic,
        Role.REWARD_MODEL: rl and cfg.reward_model.model_path is not None,
        Role.JUDGE: rl and getattr(cfg.judge, "model_path", None) is not None,
        Role.SHADOW: rl and bool(cfg.shadow_every),
    }
    return [role for role, started in starts.items() if started]


def run_roles(cfg: Any, spec: Any) -> list[Role]:
    """Every role this run starts: :func:`role_names`' placed roles, then the env workers
    (``RunConfig.episodes``) and the rule-reward workers (an algorithm that scores with
    reward functions)."""
    light = {Role.ENV: cfg.episodes is not None, Role.REWARD: spec.needs_reward}
    return role_names(cfg, spec) + [role for role, started in light.items() if started]


def trained_roles(cfg: Any, spec: Any) -> list[Role]:
    """The roles of this run with an optimizer (their state goes into checkpoints)."""
    return [role for role in role_names(cfg, spec) if ROLE_TABLE[role].trained]
