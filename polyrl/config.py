"""Frozen configuration dataclasses: what travels from the driver to Ray actors.

gin is resolved on the driver only (docs/design.md "Configuration"): the entry point turns
gin bindings into these frozen, validated dataclasses, and these — never gin — are
sent to workers. Every check failure names the field to change.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

from polyrl.errors import raise_if_problems
from polyrl.role_table import DEFAULT_POOL, ENGINE_ROLES, ROLE_TABLE, Role

__all__ = [
    "MESH_AXES",
    "DEFAULT_LOGICAL_RULES",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RoleConfig",
]

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes (parallelism is data: docs/design.md "TrainEngine"). A backend turns these into its own objects
# (DeviceMesh + fully_shard / NamedSharding). Parameters' logical axes: "embed" (hidden
# size), "mlp" (intermediate size), "heads" (attention heads * head_dim), "kv_heads",
# "vocab"; activations: "batch", "length".
DEFAULT_LOGICAL_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("vocab", ("tensor",)),
    ("length", ()),
)

DTYPES = ("float32", "bfloat16", "float16")
CHECKPOINT_POLICIES = ("full", "selective", "budget")
# The projections LoRA can adapt: HF's module names inside a decoder layer of the
# Llama/Qwen families, the same names on both backends (the JAX models use HF's names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections the rollout engine loads as one layer (vLLM's qkv_proj, gate_up_proj): a
# layer given part of its tensors is rebuilt from that part alone, so a partial weight
# sync sends all of a group (LoraConfig.changes).
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def closest(name: object, choices: object) -> str | None:
    """The valid name nearest to a misspelled ``name`` (difflib), or None."""
    import difflib

    found = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(name: object, choices: object) -> str:
    """ "; did you mean 'x'?" when a valid name is close to ``name``, else ""."""
    guess = closest(name, choices)
    return f"; did you mean {guess!r}?" if guess else ""


def _choice(owner: str, field: str, value: object, choices: tuple) -> list[str]:
    """The problem of ``owner.field=value`` outside ``choices`` (a list of 0 or 1)."""
    if value in choices:
        return []
    return [
        f"{owner}.{field}={value!r} is not one of {[str(c) for c in choices]}"
        f"{did_you_mean(value, choices)}"
    ]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al. 2021) on the actor: ``W x + (alpha / rank) * B A dropout(x)`` for
    each target projection, ``A`` [rank, in] random (:meth:`initial_a`), ``B`` [out, rank]
    zero at start, so
    the first forward equals the base model's. Only ``A`` and ``B`` train; the base
    weights stay frozen (docs/training.md "LoRA").

    rank / alpha: the adapters' rank and scale numerator (scale = alpha / rank).
    dropout: dropout probability on the adapters' input path (training only).
    target_modules: projections to adapt, by HF module name (:data:`LORA_TARGETS`).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def changes(self, hf_name: str) -> bool:
        """Whether tensor ``hf_name`` (an HF name, with or without the adapters' infixes)
        is one a sync after training must send: it belongs to a target projection or to
        one fused with a target (:data:`FUSED_PROJECTIONS`). The rest is the frozen base."""
        parts = set(hf_name.split("."))
        sent = set(self.target_modules)
        sent.update(p for group in FUSED_PROJECTIONS if sent & set(group) for p in group)
        return bool(parts & sent)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        out = []
        if self.rank < 1:
            out.append(f"LoraConfig.rank={self.rank} must be >= 1 (e.g. 8, 16, 64)")
        if self.alpha <= 0:
            out.append(f"LoraConfig.alpha={self.alpha} must be > 0 (e.g. 2 x rank)")
        if not 0 <= self.dropout < 1:
            out.append(f"LoraConfig.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            out.append(f"LoraConfig.target_modules is empty; name some of {list(LORA_TARGETS)}")
        out += [
            f"LoraConfig.target_modules has {name!r}, which is no projection of the "
            f"model's decoder layers; valid: {list(LORA_TARGETS)}"
            f"{did_you_mean(name, LORA_TARGETS)}"
            for name in self.target_modules
            if name not in LORA_TARGETS
        ]
        if len(set(self.target_modules)) != len(self.target_modules):
            out.append(
                f"LoraConfig.target_modules={list(self.target_modules)} names a module twice"
            )
        raise_if_problems(out)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def initial_a(self, target: str, shape: tuple[int, int]) -> object:
        """The initial ``A`` [rank, in] of the adapter on ``target`` (its HF module path,
        e.g. ``model.layers.0.self_attn.q_proj``): PEFT's Kaiming-uniform
        U(-1/sqrt(in), 1/sqrt(in)), fp32 numpy, drawn from a generator seeded by the path,
        so both backends and every run start from the same adapters."""
        import zlib

        import numpy as np

        bound = 1.0 / math.sqrt(shape[1])
        rng = np.random.default_rng(zlib.crc32(target.encode()))
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    def manifest(self) -> dict:
        """The fields as a checkpoint's JSON manifest records them (lists, not tuples)."""
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model a role trains or runs.

    path: local Hugging Face directory (config.json + safetensors + tokenizer).
    role: an engine role of ``polyrl.role_table.ROLE_TABLE`` ("actor", "reference",
      "teacher", "critic", "reward_model", "shadow"); the table says whether it trains (an
      optimizer) and whether it adds a scalar value head on the last hidden state
      (critic, reward_model) instead of scoring tokens.
    value_head_path: for a value-head role, a checkpoint whose ``score``/``value_head``
      weights initialise the head (e.g. a reward model); None -> zero-initialised head.
    dtype: parameter dtype ("float32" on CPU; "bfloat16" on GPU with fp32 reductions).
    gradient_checkpointing: activation checkpointing per decoder layer: activations
      are dropped after the forward pass and recomputed in the backward pass, as
      ``checkpoint_policy`` says. Memory for compute; never changes results.
    checkpoint_policy: with ``gradient_checkpointing``, what each decoder layer keeps
      (docs/backends.md, "Activation checkpointing"): "full" keeps only the layer's
      input and recomputes the whole layer; "selective" keeps the matmul outputs
      (q/k/v/o and MLP projections) and the attention output, and recomputes only the
      elementwise work (norms, rotary, activation, residual adds). torch with ``compile``:
      compiled layers already keep that much without checkpointing (inductor's
      partitioner), so "selective" adds nothing there and "full" is what saves memory.
      "budget": each layer keeps at most ``activation_memory_budget`` of what it keeps
      without checkpointing: torch (needs ``compile``) lets the compiler's partitioner
      choose what to recompute in each compiled layer (AOTAutograd's
      ``activation_memory_budget``); JAX recomputes the first ``round((1 - budget) * L)``
      of its ``L`` layers whole and keeps the others'.
    activation_memory_budget: the fraction of "budget" (in (0, 1]; 1 = no recompute).
    attn_implementation: torch: transformers' name (``sdpa``, ``polyrl_varlen``,
      ``flex_attention``, ...); JAX: ``auto`` (cuDNN where it applies, opt-in),
      ``cudnn`` (forced), anything else = XLA (docs/backends.md, "Attention and packing").
    sampling_vocab_size: score tokens over the first N ids only: the rollout servers
      sample only the tokenizer's ids when the embedding is padded past it (Qwen2), so
      the trainer's log-softmax must cover the same ids (RolloutPool.sampling_vocab_size).
      None: the whole embedding.
    compile: torch: ``torch.compile`` each decoder layer (attention stays an eager call)
      and the LM head's chunk scoring, so a step launches fused kernels instead of one per
      elementwise op; the first micro-batches of each shape family pay the compile time.
      JAX: no effect (XLA compiles every step whole).
    lora: a :class:`LoraConfig` for an actor trained through low-rank adapters (frozen
      base weights); None: every weight trains.
    """

    path: str
    role: str = "actor"
    dtype: str = "float32"
    value_head_path: str | None = None
    gradient_checkpointing: bool = False
    checkpoint_policy: str = "full"
    activation_memory_budget: float = 0.6
    attn_implementation: str = "sdpa"
    sampling_vocab_size: int | None = None
    compile: bool = False
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        out = _choice("ModelConfig", "role", self.role, ENGINE_ROLES)
        if self.lora is not None and self.role != Role.ACTOR:
            out.append(
                f"ModelConfig.lora is set for role {self.role!r}; LoRA trains the actor only "
                "(RunConfig.lora)"
            )
        out += _choice("ModelConfig", "dtype", self.dtype, DTYPES)
        out += _choice(
            "ModelConfig", "checkpoint_policy", self.checkpoint_policy, CHECKPOINT_POLICIES
        )
        if not 0 < self.activation_memory_budget <= 1:
            out.append(
                f"ModelConfig.activation_memory_budget={self.activation_memory_budget} must be "
                "in (0, 1]: the fraction of a layer's activations checkpoint_policy='budget' "
                "keeps (e.g. 0.6)"
            )
        if self.sampling_vocab_size is not None and self.sampling_vocab_size < 1:
            out.append(
                f"ModelConfig.sampling_vocab_size={self.sampling_vocab_size} must be >= 1 or None"
            )
        raise_if_problems(out)

    @property
    def has_value_head(self) -> bool:
        return ROLE_TABLE[Role(self.role)].value_head

    @property
    def trainable(self) -> bool:
        return ROLE_TABLE[Role(self.role)].trained


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warmup + constant/cosine schedule.

    Both backends use :meth:`lr_at`, so their schedules agree exactly.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int = 1000
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        out = _choice("OptimConfig", "schedule", self.schedule, ("constant", "cosine"))
        if self.lr < 0:
            out.append(f"OptimConfig.lr={self.lr} must be >= 0")
        if self.warmup_steps < 0:
            out.append(f"OptimConfig.warmup_steps={self.warmup_steps} must be >= 0")
        if self.total_steps <= 0:
            out.append(f"OptimConfig.total_steps={self.total_steps} must be > 0")
        if self.grad_clip is not None and self.grad_clip <= 0:
            out.append(f"OptimConfig.grad_clip={self.grad_clip} must be > 0 or None")
        raise_if_problems(out)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer update number ``step`` (0 for the first update).

        Linear warmup ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``,
        then constant, or cosine from ``lr`` down to ``lr * min_lr_ratio`` at
        ``total_steps`` (and flat after).
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The neutral parallelism spec (docs/design.md "TrainEngine": parallelism is data).

    mesh: sizes of the ("data", "fsdp", "tensor") axes; their product is the number of
      devices one role uses (torch: ranks; JAX: devices of the mesh).
    rules: logical axis -> mesh axes.
    micro_batch_size: samples per forward/backward pass on one data-parallel shard;
      gradients are accumulated over micro-batches with global normalisers, so it changes
      speed and memory, never the update.
    max_tokens_per_micro_batch: a token budget instead of a fixed row count: rows sorted
      by length fill each micro-batch while the tokens its forward computes stay within it
      (``polyrl.micro_batch``): ``rows x (longest prompt + longest response)``, the real
      tokens when packed, and on JAX after its power-of-two padding. Short rows travel in
      large micro-batches and long ones in small ones. None: ``micro_batch_size`` rows each.
      Like ``micro_batch_size``, it changes speed and memory, never the update.
    cpu_offload: keep parameters/optimizer state in host memory between uses.
    pack_sequences: run each micro-batch as one row of its real tokens (JAX: one row per
      data shard), without padding (per-sequence position ids; attention stays within
      each sequence). Same outputs, less padded compute; pair it with a varlen attention
      on torch (``attn_implementation="polyrl_varlen"``, docs/backends.md).
    logits_chunk_tokens: response tokens whose logits the LM head computes at once.
      Log-probs and entropy are computed chunk by chunk (each chunk's logits recomputed
      in the backward pass), so the fp32 [tokens x vocab] logits of a micro-batch never
      exist at once; the peak is about 3 x 4 bytes x this x vocab. Speed and memory
      only, never results.
    """

    mesh: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {"data": 1, "fsdp": 1, "tensor": 1}
    )
    rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_LOGICAL_RULES
    micro_batch_size: int = 8
    cpu_offload: bool = False
    logits_chunk_tokens: int = 1024
    max_tokens_per_micro_batch: int | None = None
    pack_sequences: bool = False

    def __post_init__(self) -> None:
        out = []
        unknown = set(self.mesh) - set(MESH_AXES)
        if unknown:
            out.append(
                f"ParallelConfig.mesh has unknown axes {sorted(unknown)}; valid axes: "
                f"{list(MESH_AXES)}{did_you_mean(min(unknown), MESH_AXES)}"
            )
        mesh = {axis: int(self.mesh.get(axis, 1)) for axis in MESH_AXES}
        bad = {k: v for k, v in mesh.items() if v < 1}
        if bad:
            out.append(f"ParallelConfig.mesh sizes must be >= 1, got {bad}")
        object.__setattr__(self, "mesh", mesh)
        if self.micro_batch_size < 1:
            out.append(f"ParallelConfig.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            out.append(
                f"ParallelConfig.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} "
                "must be >= 1 (e.g. 16384), or None for micro_batch_size rows per micro-batch"
            )
        if self.logits_chunk_tokens < 1:
            out.append(
                f"ParallelConfig.logits_chunk_tokens={self.logits_chunk_tokens} must be >= 1 "
                "(e.g. 1024)"
            )
        out += [
            f"ParallelConfig.rules maps {logical!r} to unknown mesh axis {axis!r}; "
            f"valid axes: {list(MESH_AXES)}{did_you_mean(axis, MESH_AXES)}"
            for logical, axes in self.rules
            for axis in axes
            if axis not in MESH_AXES
        ]
        raise_if_problems(out)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def dp_size(self) -> int:
        """Number of data shards: the batch is split over ("data", "fsdp")."""
        return self.mesh["data"] * self.mesh["fsdp"]

    def check_devices(self, n_devices: int, where: str = "ParallelConfig.mesh") -> None:
        if self.world_size != n_devices:
            arith = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
            raise ValueError(
                f"{where}: {arith} = {self.world_size} devices, but {n_devices} are available; "
                f"make the product of the mesh sizes equal {n_devices}"
            )


@dataclasses.dataclass(frozen=True)
class RoleConfig:
    """One engine role's own settings: ``RunConfig.actor``, ``.reference``, ``.teacher``,
    ``.critic``, ``.reward_model`` and ``.shadow`` (gin/base.gin binds each as
    ``@<role>/polyrl.RoleConfig()``, so ``actor/polyrl.ParallelConfig.micro_batch_size``
    and ``actor/polyrl.OptimConfig.lr`` reach the actor's; docs/training.md "Roles").

    parallel: the role's mesh and micro-batching.
    optim: its optimizer; a trained role (actor, critic) needs one, a frozen role none.
    pool: the ``RunConfig.pools`` entry its workers run in; roles in one pool are
      colocated (take turns on its devices).
    model_path: the checkpoint of a role with a model of its own (``own_model`` in
      ``polyrl.role_table``): the reward model's (a sequence-classification model with
      one score, same tokenizer as the policy; the reward_model role runs only when it is
      set) and the distillation teacher's (any causal LM sharing the policy's tokenizer).
      Every other role loads ``RunConfig.model_path`` and leaves it None.
    """

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optim: OptimConfig | None = None
    pool: str = DEFAULT_POOL
    model_path: str | None = None

    def problems(self, role: Role) -> list[str]:
        """What is wrong with these settings for ``role`` (each naming the binding)."""
        facts, at = ROLE_TABLE[role], f"{role}/polyrl.RoleConfig"
        out = []
        if facts.trained and self.optim is None:
            out.append(f"{at}.optim is None but the {role} trains; bind @polyrl.OptimConfig()")
        if not facts.trained and self.optim is not None:
            out.append(f"{at}.optim is set but the {role} is frozen (no optimizer); unbind it")
        if self.model_path is not None and not facts.own_model:
            own = [str(r) for r, f in ROLE_TABLE.items() if f.own_model and f.kind == "engine"]
            out.append(
                f"{at}.model_path={self.model_path!r}: the {role} loads RunConfig.model_path; "
                f"unbind it (only the {' and '.join(own)} roles have checkpoints of their own)"
            )
        return out


def _moved(field: str, value: object) -> str | None:
    """The binding(s) that replace the RunConfig ``field`` bound to ``value``, for the
    per-role fields that moved under their role (see ``RunConfig.moved``)."""
    nested = {
        "optim": ("actor", "optim", "OptimConfig.lr"),
        "critic_optim": ("critic", "optim", "OptimConfig.lr"),
        "actor_parallel": ("actor", "parallel", "ParallelConfig.micro_batch_size"),
        "ref_parallel": ("reference", "parallel", "ParallelConfig.micro_batch_size"),
        "critic_parallel": ("critic", "parallel", "ParallelConfig.micro_batch_size"),
        "reward_parallel": ("reward_model", "parallel", "ParallelConfig.micro_batch_size"),
    }
    if field in nested:
        role, sub, example = nested[field]
        return (
            f"`{role}/polyrl.RoleConfig.{sub} = ...` (gin/base.gin binds it; set its fields "
            f"in the role's scope, e.g. `{role}/polyrl.{example} = ...`)"
        )
    if field == "reward_model_path":
        return f"`reward_model/polyrl.RoleConfig.model_path = {value!r}`"
    if field == "role_pools":
        pools = value if isinstance(value, Mapping) else {"<role>": "<pool>"}
        lines = [
            f"polyrl.RolloutConfig.pool = {pool!r}"
            if role == Role.ROLLOUT
            else f"{'reward_model' if role == 'reward' else role}/polyrl.RoleConfig.pool = {pool!r}"
            for role, pool in pools.items()
        ]
        return "; ".join(f"`{line}`" for line in lines)
    return None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run (``polyrl train``): resolved from gin on the driver, then frozen.

    Batch arithmetic (checked by ``polyrl.configure.validate``): each step samples
    ``prompts_per_step`` prompts x ``sampling.n`` responses; the actor takes
    ``prompts_per_step / mini_batch_prompts`` optimizer steps per epoch, each on
    ``mini_batch_prompts * n`` samples split over its data-parallel shards and then into
    micro-batches of ``actor.parallel.micro_batch_size``.

    run_dir: where the operative config, metrics, TensorBoard events, checkpoints and
      the plot go. model_path: local HF model for actor, reference (a separate frozen
      instance) and rollout; None builds the embedded tiny model under ``run_dir``, of
      the shape ``tiny_model`` gives (a ``polyrl.data.tiny.TinyModelSpec``; None: the
      default).
    train_files: RL datasets: .parquet/.jsonl files, shard directories, HF save_to_disk
      folders, in polyrl's or verl's schema (polyrl.data.formats); empty -> ``task`` rows
      generated on the fly (``n_train_prompts`` of them). algo_overrides: AlgorithmSpec
      fields.
    val_files / n_val_prompts / eval_every / val_sampling: validation during training
      (polyrl.loop.evaluation, docs/training.md): every ``eval_every`` steps (0: off), and once
      before the first step and after the last, the held-out prompts of ``val_files``
      (without files: ``n_val_prompts`` ``task`` rows of the test split) are sampled with
      ``val_sampling`` (a SamplingSpec; None: greedy, one sample) and scored by the
      training rewards; ``val/...`` metrics go to every tracker.
    max_gen_batches: with DAPO's dynamic sampling, how many prompt batches a step may
      generate to find ``prompts_per_step`` groups whose rewards differ.
    actor / reference / teacher / critic / reward_model / shadow: each engine role's own
      :class:`RoleConfig` (mesh and micro-batching, optimizer, pool; the reward model's
      and the teacher's checkpoints); gin/base.gin binds ``@<role>/polyrl.RoleConfig()``.
      ``shadow`` None: laid out as the reference. The teacher runs with an algorithm that
      reads its log-probs (``distillation``: ``teacher/polyrl.RoleConfig.model_path``).
      The rollout servers' are ``rollout`` (a RolloutConfig).
    reward_model_coef: with ``reward_model.model_path`` set, the frozen reward_model
      role scores each response (a sequence-classification checkpoint, one score, e.g.
      saved by ``AutoModelForSequenceClassification``; same tokenizer as the policy);
      its reward is its rule reward + ``reward_model_coef`` x the model's score at the
      last token. Unset: rule rewards only.
    offload_colocated: colocated roles take turns: engines that share a GPU pool with
      another role stay in host memory except during their phases, and rollout servers
      that share it sleep while the trainer works (with RolloutConfig.enable_sleep_mode).
      False: every engine stays resident. None: take turns unless everything fits side
      by side on the GPUs, measured after start-up (``polyrl.cluster.residency``).
    model_dtype / gradient_checkpointing / checkpoint_policy: the trained and reference
      engines' parameter dtype ("bfloat16" on GPU), activation checkpointing and what it
      keeps ("full": each layer's input only; "selective": also the matmul and attention
      outputs, recomputing only elementwise work; "budget": at most
      ``activation_memory_budget`` of what no checkpointing keeps, torch with ``compile``
      choosing what): the ``ModelConfig`` fields.
    attn_implementation: every engine's ``ModelConfig.attn_implementation`` (torch:
      transformers' name or ``polyrl_varlen``; JAX: ``auto``/``cudnn`` for cuDNN, else
      XLA; docs/backends.md).
    compile: every engine's ``ModelConfig.compile`` (torch: ``torch.compile`` per decoder
      layer and LM-head chunk; JAX: no effect).
    lora: a ``LoraConfig`` (gin: ``@polyrl.LoraConfig()``): the actor trains low-rank
      adapters on frozen base weights; the reference is then the actor with its adapters
      off (no second copy of the weights), and the rollout servers get merged weights
      (docs/training.md "LoRA"). None: full fine-tuning.
    weight_transport: trainer -> rollout weight sync: "object_store" (any placement),
      "cuda_ipc" (actor and rollout colocated on the same GPUs) or "nccl" (separate GPUs).
    weight_bucket_mb: the size of one weight-sync bucket (MiB). None: the transport's
      (``polyrl.weight_sync.bucket_bytes``: 1024 for CUDA IPC, 64 otherwise).
    max_staleness / stale_policy: how many policy versions a sample may lag the trainer
      (``polyrl.loop.async_rollout``): 0 synchronous (every batch sampled by the current
      weights); N >= 1: the rollout servers generate batches up to N steps ahead while
      the actor trains (staleness <= N, logged as ``rollout/staleness_mean`` / ``_max``).
      Rows older than N (a checkpoint written with a larger N) are dropped with their
      group (``"drop"``) or kept for the off-policy correction (``"reweight"``).
      async_rollout: the former switch; True means max_staleness = 1.
    streaming: generate groups continuously and batch them as they finish, staleness
      checked per sample (``polyrl.loop.streaming``; docs/training.md "Streaming").
      partial_rollout_tokens: with streaming, sample at most this many tokens a request and
      resume a cut sample from its tokens, so weights change between chunks (0: whole
      requests).
    export_every / export_final: write the actor's weights (a reward-model run's: the
      critic's, as a sequence classifier) as a Hugging Face directory
      (safetensors + config + tokenizer, ``polyrl.backends.hf_dir``) every ``export_every``
      steps to ``<run_dir>/exports/step_N`` (0: never) and, with ``export_final``, after
      the last step to ``<run_dir>/hf`` (the directory another run's ``model_path``,
      transformers or vLLM loads).
    max_nonfinite_steps: a step whose loss or gradients are not finite skips its update
      (weights and optimizer state unchanged); this many such steps in a row stop the run
      with a checkpoint (0: never stop). See docs/reliability.md.
    sampling / rollout: ``polyrl.rollout`` SamplingSpec / RolloutConfig (rollout's
      model_path is filled from ``model_path`` when left empty).
    imports: user modules (``pkg.mod`` names) imported in the driver and in every Ray
      worker before anything runs, e.g. the module that registers an own reward or task
      (``polyrl.cluster.user_code``); ``--import`` on the command line adds to them.
    reward_workers / reward_timeout_s: rule rewards run in this many Ray reward workers
      (``polyrl.rewards.workers``; 0: in the driver), each call checked and stopped after
      ``reward_timeout_s`` seconds (None: no limit).
    user_cpus: logical CPUs left free for the user's own Ray tasks and actors (a remote
      verifier, a sandbox) when polyrl starts Ray itself: Ray gets the pools' CPUs plus
      these. A task that waits for resources longer than a minute is reported.
    dump_every / dump_samples: every ``dump_every`` steps (0: never), write
      ``dump_samples`` decoded samples to ``<run_dir>/rollouts.jsonl`` (``polyrl.loop.dumps``).
    shadow_every / shadow_tolerance: at step 1 and every ``shadow_every`` steps after it
      (0: never) the step's batch is scored again by the other backend with the actor's
      weights and compared three ways with vLLM's and the trainer's log-probs
      (``polyrl.observe.shadow``; docs/diagnosis.md); a side whose mean gap to both others
      exceeds ``shadow_tolerance`` (nats per token) while they agree is named in a warning.
    shadow_per_prompt: the check scores this many responses of each prompt (the first of
      its group; None: every response): the ``n`` samples of a prompt share its context, so
      more of them add little evidence and cost a forward each.
    timeline: write each phase of each role as spans to ``<run_dir>/timeline.json``
      (Chrome/Perfetto trace, ``polyrl.observe.timeline``).
    profile_steps: steps (1 = the first) during which every trainer role's worker (actor,
      reference, critic, reward model) runs under its framework's profiler
      (``polyrl.observe.profiler``: torch.profiler, jax.profiler); each step's traces go to
      ``<run_dir>/profile/step_<k>/`` with ``summary.json`` (each worker's top ops).
    episodes: ``polyrl.envs.EpisodeConfig``: every row is a multi-turn episode played by
      the environment its ``data_source`` names (docs/agents.md); None: single-turn.
    judge: ``polyrl.JudgeConfig`` (``polyrl.loop.judge``): an LLM judge on the rollout
      pool (or on servers of its own: ``JudgeConfig.model_path``) scores every response;
      ``JudgeConfig.coef`` x its score is added to the reward (docs/rewards.md "Reward
      models and judges"). None: no judge.
    debug: ``polyrl.observe.debug.DebugConfig`` (breakpoints inside remote roles; gin/base.gin
      binds ``@polyrl.DebugConfig()``), turned on by ``polyrl train --debug``.
    tinker: :class:`TinkerConfig`: the settings of ``polyrl
      serve-tinker`` (gin/experiments/tinker_service.gin binds it; docs/tinker.md); a
      training run ignores it.
    cache_dir: where compiled programs are kept across runs (``polyrl.compile_cache``:
      torch Inductor/Triton, JAX's persistent cache, vLLM's compile cache), and the
      tokenizer class AutoTokenizer picked per model directory (``polyrl.data.tokenizer``:
      the driver's checks then load it without importing torch), shared safely by
      concurrent runs; a warm cache shortens the first step. None or "": each
      framework's own default (JAX then keeps nothing; the tokenizer through AutoTokenizer).
    warm_up: each engine role prepares its first step's programs while the rollout
      servers start (``TrainEngine.warm_up``: torch's compiled graphs on a few rows of a
      placeholder batch, JAX's jitted programs compiled ahead for its padded shapes),
      so step 1 does not compile; changes no number. Single-turn runs without streaming
      (multi-turn episodes and the stream shape their batches otherwise: they compile in
      step 1). False: every program compiles on its first call.
    """

    run_dir: str
    backend: str = "torch_fsdp"
    algorithm: str = "grpo"
    algo_overrides: Mapping[str, object] = dataclasses.field(default_factory=dict)
    model_path: str | None = None
    tiny_model: object = None
    train_files: tuple[str, ...] = ()
    task: str = "copy"
    n_train_prompts: int = 1024
    val_files: tuple[str, ...] = ()
    n_val_prompts: int = 0
    eval_every: int = 0
    val_sampling: object = None
    total_steps: int = 20
    prompts_per_step: int = 16
    mini_batch_prompts: int = 16
    epochs: int = 1
    max_gen_batches: int = 3
    sampling: object = None
    rollout: object = None
    actor: RoleConfig = dataclasses.field(default_factory=lambda: RoleConfig(optim=OptimConfig()))
    reference: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    teacher: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    critic: RoleConfig = dataclasses.field(default_factory=lambda: RoleConfig(optim=OptimConfig()))
    reward_model: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    shadow: RoleConfig | None = None
    reward_model_coef: float = 1.0
    pools: Mapping[str, Mapping[str, float]] = dataclasses.field(
        default_factory=lambda: {DEFAULT_POOL: {"CPU": 2.0, "GPU": 0.0}}
    )
    offload_colocated: bool | None = None
    model_dtype: str = "float32"
    gradient_checkpointing: bool = False
    checkpoint_policy: str = "full"
    activation_memory_budget: float = 0.6
    attn_implementation: str = "sdpa"
    compile: bool = False
    lora: LoraConfig | None = None
    weight_transport: str = "object_store"
    async_rollout: bool = False
    max_staleness: int = 0
    stale_policy: str = "drop"
    streaming: bool = False
    partial_rollout_tokens: int = 0
    weight_bucket_mb: float | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    export_every: int = 0
    export_final: bool = True
    max_nonfinite_steps: int = 3
    seed: int = 0
    tensorboard: bool = True
    wandb_project: str | None = None
    ray_num_cpus: float | None = None
    imports: tuple[str, ...] = ()
    reward_workers: int = 2
    reward_timeout_s: float | None = 60.0
    user_cpus: float = 1.0
    dump_every: int = 10
    dump_samples: int = 4
    shadow_every: int = 0
    shadow_tolerance: float = 0.02
    shadow_per_prompt: int | None = 1
    timeline: bool = True
    profile_steps: tuple[int, ...] = ()
    episodes: object = None
    judge: object = None
    debug: object = None
    tinker: object = None
    cache_dir: str | None = "~/.cache/polyrl"
    warm_up: bool = True

    # Former fields -> the bindings that replace them (polyrl.configure.bindings names them).
    moved: ClassVar = staticmethod(_moved)

    def role_config(self, role: str) -> RoleConfig:
        """``role``'s own settings (its RunConfig field, ``polyrl.role_table``): a
        RoleConfig, the rollout's RolloutConfig; the shadow's, unless bound, are the
        reference's."""
        facts = ROLE_TABLE[Role(role)]
        found = getattr(self, facts.config)
        if found is None and facts.layout_of is not None:
            return self.role_config(facts.layout_of)
        return found


@dataclasses.dataclass(frozen=True)
class TinkerConfig:
    """``polyrl serve-tinker``'s own settings (``polyrl.service``; docs/tinker.md):
    ``polyrl.RunConfig.tinker = @polyrl.TinkerConfig()`` (gin/experiments/tinker_service.gin),
    then ``polyrl.TinkerConfig.*``.

    max_training_clients: training clients served at once. Each one's workers are the
      actor's (``actor/polyrl.RoleConfig.pool``, ``polyrl.RunConfig.pools``) and ask for
      ``1/max_training_clients`` of the actor's share of its pool (CPUs and GPUs): that
      many share the actor's devices, and one more is refused until a session closes.
    """

    max_training_clients: int = 4

    def __post_init__(self) -> None:
        if self.max_training_clients < 1:
            raise ValueError(
                f"TinkerConfig.max_training_clients={self.max_training_clients} must be >= 1"
            )


SPACE_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A Ray Tune sweep over gin bindings (``polyrl sweep``; docs/training.md "Sweeps").

    space: gin binding -> ``{"grid": [v, ...]}`` (every value), ``{"choice": [v, ...]}``,
      ``{"uniform": [lo, hi]}``, ``{"loguniform": [lo, hi]}`` or ``{"randint": [lo, hi]}``
      (sampled once per trial). Any binding, e.g. ``"polyrl.RunConfig.backend"``.
    grid: shorthand: binding -> list of values, the same as ``{"grid": [...]}`` in space.
    num_samples: trials per grid combination (random search draws each sample anew).
    search: "random" (Tune's grid + random sampling) or "optuna" (TPE; needs optuna).
    scheduler: "fifo" (every trial runs to the end) or "asha" (ASHA early stopping:
      trials behind the others at step ``grace_period * reduction_factor**k`` stop).
    metric / mode: what trials are ranked and stopped by (any key of metrics.jsonl) and
      "max"/"min"; ranking uses the mean over the last ``smooth_steps`` steps.
    max_concurrent_trials: trials at once; 0 = as many as the cluster holds (each trial
      reserves a placement group of its run's pools).
    """

    space: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    grid: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    metric: str = "reward/mean"
    mode: str = "max"
    num_samples: int = 1
    search: str = "random"
    scheduler: str = "fifo"
    grace_period: int = 5
    reduction_factor: float = 2.0
    smooth_steps: int = 5
    max_concurrent_trials: int = 0

    def __post_init__(self) -> None:
        raise_if_problems(
            _choice("SweepConfig", "mode", self.mode, ("max", "min"))
            + _choice("SweepConfig", "search", self.search, ("random", "optuna"))
            + _choice("SweepConfig", "scheduler", self.scheduler, ("fifo", "asha"))
        )
        for key, values in self.grid.items():
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(
                    f"SweepConfig.grid[{key!r}] must be a non-empty list of values, got {values!r}"
                )
        for key, spec in self.space.items():
            kind = next(iter(spec), None) if isinstance(spec, Mapping) else None
            if kind not in SPACE_KINDS or len(spec) != 1:
                raise ValueError(
                    f"SweepConfig.space[{key!r}] = {spec!r}: give one of "
                    f"{{'grid': [...]}}, {{'choice': [...]}}, {{'uniform': [lo, hi]}}, "
                    f"{{'loguniform': [lo, hi]}}, {{'randint': [lo, hi]}}"
                )
            args = spec[kind]
            ok = isinstance(args, (list, tuple)) and len(args) >= 1
            if kind in ("uniform", "loguniform", "randint"):
                ok = ok and len(args) == 2 and args[0] < args[1]
                ok = ok and (kind != "loguniform" or args[0] > 0)
            if not ok:
                raise ValueError(
                    f"SweepConfig.space[{key!r}] = {spec!r}: {kind} needs "
                    + (
                        "a non-empty list"
                        if kind in ("grid", "choice")
                        else "[lo, hi] with lo < hi"
                    )
                    + (" and lo > 0" if kind == "loguniform" else "")
                )
        overlap = set(self.grid) & set(self.space)
        if overlap:
            raise ValueError(f"SweepConfig: {sorted(overlap)} bound in both grid and space")
        grids = bool(self.grid) or any("grid" in spec for spec in self.space.values())
        if self.search == "optuna" and grids:
            raise ValueError(
                "SweepConfig.search = 'optuna' samples every binding: use choice instead of "
                "grid (SweepConfig.grid / {'grid': ...} in SweepConfig.space)"
            )
        for name in ("num_samples", "grace_period", "smooth_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SweepConfig.{name}={getattr(self, name)} must be >= 1")
        if self.reduction_factor <= 1 or self.max_concurrent_trials < 0:
            raise ValueError(
                f"SweepConfig.reduction_factor={self.reduction_factor} must be > 1 and "
                f"SweepConfig.max_concurrent_trials={self.max_concurrent_trials} >= 0"
            )

    @property
    def bindings(self) -> dict[str, Mapping[str, object]]:
        """Every swept binding -> its space entry (grid shorthand included)."""
        return {**{k: {"grid": list(v)} for k, v in self.grid.items()}, **dict(self.space)}
