"""The algorithm registry: every algorithm polyrl knows, by name.

``get_algorithm(name)`` is how a trainer (and a gin file's ``algorithm = "grpo"``) picks
an algorithm; this registry is the one source of valid names. Each entry is a frozen
``AlgorithmSpec`` (``polyrl.algos.spec``); hyper-parameters are overridden with
``spec.replace(...)`` or ``spec.make_actor_loss(**overrides)``.

How the defaults were chosen: the paper's objective (aggregation mode, clip range,
whether there is a KL term); where the paper is silent, verl's defaults and example
scripts (KL coefficient 0.001, ``k3`` KL loss, dual clip 3.0 for the PPO loss, value
clip 0.5, ``gamma = 1``). docs/algorithms.md has the equations.
"""

from __future__ import annotations

from polyrl.algos.spec import AlgorithmSpec

__all__ = ["ALGORITHMS", "register_algorithm", "get_algorithm", "algorithm_names"]

ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` under ``spec.name``; ValueError if the name is taken."""
    if spec.name in ALGORITHMS:
        raise ValueError(
            f"algorithm {spec.name!r} is already registered; registered: {sorted(ALGORITHMS)}"
        )
    ALGORITHMS[spec.name] = spec
    return spec


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec registered as ``name``; ValueError listing the valid names otherwise."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid names: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def algorithm_names() -> list[str]:
    """All registered names, sorted."""
    return sorted(ALGORITHMS)


PPO = register_algorithm(
    AlgorithmSpec(
        name="ppo",
        paper="Schulman et al. 2017 (arXiv:1707.06347); RLHF: Ouyang et al. 2022 (arXiv:2203.02155)",
        advantage="gae",
        policy_loss="ppo",
        gamma=1.0,
        lam=0.95,
        kl_in_reward=True,
        kl_reward_kind="k1",
        kl_ctrl="fixed",
        kl_coef=0.001,
    )
)

GRPO = register_algorithm(
    AlgorithmSpec(
        name="grpo",
        paper="Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)",
        advantage="grpo",
        policy_loss="ppo",
        agg="seq-mean-token-mean",  # the paper's 1/G sum_i 1/|o_i| sum_t (verl's scripts: token-mean)
        use_kl_loss=True,
        kl_loss_kind="k3",
        kl_loss_coef=0.001,
    )
)

DR_GRPO = register_algorithm(
    AlgorithmSpec(
        name="dr_grpo",
        paper="Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)",
        advantage="grpo",
        policy_loss="ppo",
        scale_by_std=False,
        agg="seq-mean-token-sum-norm",
    )
)

DAPO = register_algorithm(
    AlgorithmSpec(
        name="dapo",
        paper="Yu et al. 2025, DAPO (arXiv:2503.14476)",
        advantage="grpo",
        policy_loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        dynamic_sampling=True,
        overlong_buffer_len=4096,
        overlong_penalty_factor=1.0,
    )
)

GSPO = register_algorithm(
    AlgorithmSpec(
        name="gspo",
        paper="Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)",
        advantage="grpo",
        policy_loss="gspo",
        clip_low=3e-4,
        clip_high=4e-4,
        dual_clip=None,
        agg="seq-mean-token-mean",
    )
)

RLOO = register_algorithm(
    AlgorithmSpec(
        name="rloo",
        paper="Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740)",
        advantage="rloo",
        policy_loss="ppo",
        kl_in_reward=True,
        kl_reward_kind="k1",
        kl_coef=0.001,
    )
)

REINFORCE_PP = register_algorithm(
    AlgorithmSpec(
        name="reinforce_pp",
        paper="Hu 2025, REINFORCE++ (arXiv:2501.03262)",
        advantage="reinforce_plus_plus",
        policy_loss="ppo",
        gamma=1.0,
        kl_in_reward=True,
        kl_reward_kind="k1",
        kl_coef=0.001,
    )
)

REMAX = register_algorithm(
    AlgorithmSpec(
        name="remax",
        paper="Li et al. 2023, ReMax (arXiv:2310.10505)",
        advantage="remax",
        policy_loss="ppo",
        kl_in_reward=True,
        kl_reward_kind="k1",
        kl_coef=0.001,
    )
)

CISPO = register_algorithm(
    AlgorithmSpec(
        name="cispo",
        paper="MiniMax 2025, MiniMax-M1 (arXiv:2506.13585)",
        advantage="grpo",
        policy_loss="cispo",
        clip_low=1.0,
        clip_high=0.2,
        dual_clip=None,
        agg="token-mean",
    )
)

DISTILLATION = register_algorithm(
    AlgorithmSpec(
        name="distillation",
        paper=(
            "on-policy distillation: Agarwal et al. 2024, GKD (arXiv:2306.13649); Thinking "
            "Machines 2025, On-Policy Distillation; Qwen3 (arXiv:2505.09388)"
        ),
        advantage="distillation",  # -kl_coef (log pi_student - log pi_teacher) per token
        policy_loss="ppo",
        agg="token-mean",
        distill_coef=1.0,
        distill_discount=0.0,
        task_reward_coef=0.0,
    )
)

DPO = register_algorithm(
    AlgorithmSpec(
        name="dpo",
        paper="Rafailov et al. 2023, Direct Preference Optimization (arXiv:2305.18290)",
        objective="preference",
        advantage=None,
        beta=0.1,
        dpo_kind="sigmoid",
        label_smoothing=0.0,
    )
)

SFT = register_algorithm(
    AlgorithmSpec(
        name="sft",
        paper="supervised fine-tuning on chat data (Ouyang et al. 2022, arXiv:2203.02155, step 1)",
        objective="sft",
        advantage=None,
    )
)

REWARD_MODEL = register_algorithm(
    AlgorithmSpec(
        name="reward_model",
        paper="Bradley-Terry reward model (Bradley & Terry 1952; Ouyang et al. 2022, arXiv:2203.02155, step 2)",
        objective="reward_model",
        advantage=None,
    )
)
