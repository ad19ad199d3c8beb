"""Checks that run before any worker starts or any device is touched.

``check_run(cfg, spec)`` returns every problem with the bound configuration — batch
arithmetic, role isolation, device mapping, the cluster environment — each naming the
gin binding to change, its value and the fix. ``polyrl validate-config`` prints them;
``polyrl train`` refuses to start while any remains.
"""

from __future__ import annotations

import math
import os
from typing import Any

from polyrl.config import RunConfig, closest
from polyrl.errors import ConfigError, raise_if_problems
from polyrl.loop.async_rollout import async_problems
from polyrl.loop.evaluation import check_validation
from polyrl.role_table import exported_role

__all__ = ["ConfigError", "check_run", "check_cluster", "raise_if_problems", "closest"]


def _largest_divisor(total: int, at_most: int) -> int:
    return max(d for d in range(1, max(1, min(total, at_most)) + 1) if total % d == 0)


def _dp_fix(mini: int, n: int, dp: int) -> int:
    """The smallest mini_batch_prompts >= ``mini`` whose samples split over ``dp`` shards."""
    step = dp // math.gcd(n, dp)
    return -(-mini // step) * step


def rows_per_prompt(cfg: RunConfig, spec: Any) -> int:
    """Rows a step trains on per data row: n samples (RL), 2 (DPO: chosen and
    rejected), 1 (SFT: the conversation)."""
    return {"rl": cfg.sampling.n, "preference": 2, "sft": 1}[spec.data_kind]


def batch_arithmetic(cfg: RunConfig, spec: Any, dataset_rows: int | None = None) -> list[str]:
    """The batch arithmetic of one run, as lines of arithmetic (validate-config prints it)."""
    n = rows_per_prompt(cfg, spec)
    unit = {"rl": "samples", "preference": "rows (chosen + rejected)", "sft": "conversations"}[
        spec.data_kind
    ]
    minis = cfg.prompts_per_step // max(cfg.mini_batch_prompts, 1)
    trained = exported_role(spec)  # the actor, or the reward model trained as the critic
    par = cfg.role_config(trained).parallel
    per_rank = cfg.mini_batch_prompts * n // max(par.dp_size, 1)
    lines = [
        f"step: prompts_per_step {cfg.prompts_per_step} x n {n} = {cfg.prompts_per_step * n} {unit}",
        f"optimizer: {cfg.prompts_per_step} / mini_batch_prompts {cfg.mini_batch_prompts} = "
        f"{minis} mini-batch(es) x epochs {cfg.epochs} = {minis * cfg.epochs} updates a step, "
        f"{minis * cfg.epochs * cfg.total_steps} in {cfg.total_steps} steps",
        f"{trained}: {cfg.mini_batch_prompts * n} {unit} / dp {par.dp_size} = {per_rank} per rank "
        f"= {-(-per_rank // par.micro_batch_size)} micro-batch(es) of <= {par.micro_batch_size}",
    ]
    if spec.objective == "rl" and cfg.rollout is not None:
        r = cfg.rollout
        kind = "asynchronous" if r.asynchronous else "synchronous"
        lines.append(
            f"rollout: {r.num_servers} server(s) x tensor_parallel {r.tensor_parallel_size}, "
            f"vLLM's {kind} engine (RolloutConfig.engine={r.engine!r})"
        )
        lines.append(rollout_limits(r))
        judge = cfg.judge
        if judge is not None:
            where = (
                f"{judge.model_path} on {judge.num_servers} server(s) of its own x "
                f"tensor_parallel {judge.tensor_parallel_size} in pool {judge.pool!r}"
                if judge.model_path is not None
                else "the rollout servers (the policy)"
            )
            lines.append(f"judge: {where}, one request per sample a step")
    if dataset_rows is not None:
        used = cfg.total_steps * cfg.prompts_per_step
        lines.append(
            f"data: total_steps {cfg.total_steps} x prompts_per_step {cfg.prompts_per_step} = "
            f"{used} prompts over {dataset_rows} rows = {used / max(dataset_rows, 1):.2f} passes"
        )
    return lines


def rollout_limits(rollout: Any) -> str:
    """validate-config's line on the engine's scheduler limits (``RolloutConfig``)."""
    values = []
    for knob in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(rollout, knob)
        values.append(f"{knob} {value if value is not None else 'as vllm.LLM'}")
    return (
        f"rollout limits: {', '.join(values)}, the same for both engines "
        "(RolloutConfig.max_num_seqs / max_num_batched_tokens; None takes what vllm.LLM picks "
        "on the servers' device: 1024 / 16384 on an H100 or H200, 256 / max(4096, "
        "max_model_len) on CPU)"
    )


def _batch_problems(cfg: RunConfig, spec: Any) -> list[str]:
    out = []
    if cfg.export_every < 0:
        out.append(
            f"RunConfig.export_every={cfg.export_every} must be >= 0 (N: a Hugging Face export "
            f"every N steps, 0: none; RunConfig.export_final exports the last step)"
        )
    n = rows_per_prompt(cfg, spec)
    if cfg.prompts_per_step % cfg.mini_batch_prompts:
        out.append(
            f"RunConfig.prompts_per_step={cfg.prompts_per_step} is not a multiple of "
            f"RunConfig.mini_batch_prompts={cfg.mini_batch_prompts}: every optimizer step must "
            f"see the same number of prompts; set prompts_per_step = "
            f"{-(-cfg.prompts_per_step // cfg.mini_batch_prompts) * cfg.mini_batch_prompts} "
            f"({-(-cfg.prompts_per_step // cfg.mini_batch_prompts)} mini-batches) or "
            f"mini_batch_prompts = {_largest_divisor(cfg.prompts_per_step, cfg.mini_batch_prompts)}"
        )
    if cfg.mini_batch_prompts > cfg.prompts_per_step:
        out.append(
            f"RunConfig.mini_batch_prompts={cfg.mini_batch_prompts} exceeds "
            f"RunConfig.prompts_per_step={cfg.prompts_per_step}; lower mini_batch_prompts"
        )
    from polyrl.role_table import trained_roles

    for role in trained_roles(cfg, spec):
        par = cfg.role_config(role).parallel
        samples = cfg.mini_batch_prompts * n
        if spec.data_kind == "preference" and par.micro_batch_size % 2:
            out.append(
                f"{role}/ParallelConfig.micro_batch_size={par.micro_batch_size} is odd: a "
                f"{spec.name} micro-batch holds whole (chosen, rejected) pairs; make it even"
            )
        if samples % par.dp_size:
            out.append(
                f"RunConfig.mini_batch_prompts={cfg.mini_batch_prompts} x SamplingSpec.n={n} = "
                f"{samples} samples per optimizer step do not split over the {role}'s "
                f"{par.dp_size} data-parallel shards ({role}/ParallelConfig.mesh {dict(par.mesh)}); "
                f"{samples} % {par.dp_size} = {samples % par.dp_size}: set "
                f"RunConfig.mini_batch_prompts = {_dp_fix(cfg.mini_batch_prompts, n, par.dp_size)}"
            )
    if spec.needs_groups and n < 2:
        out.append(
            f"SamplingSpec.n={n}: algorithm {spec.name!r} compares samples of the same prompt "
            f"(group baseline), so one sample per prompt gives zero advantages; set n >= 2"
        )
    from polyrl.config import CHECKPOINT_POLICIES, DTYPES, did_you_mean

    if cfg.model_dtype not in DTYPES:
        out.append(f"RunConfig.model_dtype={cfg.model_dtype!r} is not one of {list(DTYPES)}")
    if cfg.checkpoint_policy not in CHECKPOINT_POLICIES:
        out.append(
            f"RunConfig.checkpoint_policy={cfg.checkpoint_policy!r} is not one of "
            f"{list(CHECKPOINT_POLICIES)}{did_you_mean(cfg.checkpoint_policy, CHECKPOINT_POLICIES)}"
        )
    if not 0 < cfg.activation_memory_budget <= 1:
        out.append(
            f"RunConfig.activation_memory_budget={cfg.activation_memory_budget} must be in "
            "(0, 1]: the fraction of a layer's activations checkpoint_policy='budget' keeps "
            "(e.g. 0.6)"
        )
    outside = [
        s for s in cfg.profile_steps if not (isinstance(s, int) and 1 <= s <= cfg.total_steps)
    ]
    if outside:
        out.append(
            f"RunConfig.profile_steps={list(cfg.profile_steps)}: {outside} are not steps of this "
            f"run (1 to RunConfig.total_steps={cfg.total_steps}); list steps in that range, e.g. "
            f"profile_steps = [{min(3, cfg.total_steps)}] (a step after the first compiles)"
        )
    if not (isinstance(cfg.shadow_every, int) and cfg.shadow_every >= 0) or not (
        cfg.shadow_tolerance > 0
    ):
        out.append(
            f"RunConfig.shadow_every={cfg.shadow_every!r} must be an int >= 0 (0: no shadow "
            f"check) and RunConfig.shadow_tolerance={cfg.shadow_tolerance!r} > 0 (nats per token)"
        )
    elif cfg.shadow_every and spec.objective != "rl":
        out.append(
            f"RunConfig.shadow_every={cfg.shadow_every}: algorithm {spec.name!r} samples no "
            "rollouts, so there are no vLLM log-probs to compare; set shadow_every = 0"
        )
    per = cfg.shadow_per_prompt
    if per is not None and not (isinstance(per, int) and per >= 1):
        out.append(
            f"RunConfig.shadow_per_prompt={per!r} must be an int >= 1 (responses of each "
            "prompt the shadow check scores) or None (all of them)"
        )
    if cfg.epochs < 1 or cfg.total_steps < 1:
        out.append(
            f"RunConfig.epochs={cfg.epochs} and RunConfig.total_steps={cfg.total_steps} must be >= 1"
        )
    if (
        cfg.actor.optim is not None
        and cfg.actor.optim.total_steps
        < cfg.total_steps * cfg.epochs * (cfg.prompts_per_step // max(cfg.mini_batch_prompts, 1))
        and cfg.actor.optim.schedule == "cosine"
    ):
        out.append(
            f"OptimConfig.total_steps={cfg.actor.optim.total_steps} is fewer than the run's optimizer "
            f"steps; the cosine schedule would sit at its floor — raise actor/OptimConfig.total_steps"
        )
    return out


def _rollout_problems(cfg: RunConfig) -> list[str]:
    out = []
    limit, n, length = cfg.rollout.prompt_limit, cfg.sampling.max_tokens, cfg.rollout.max_model_len
    if limit + n > length:
        # A shorter prompt limit fits only while a prompt of at least one token is left.
        shorter = (
            f" or set RolloutConfig.max_prompt_len = {length - n}"
            if length - n >= 1
            else f" (SamplingSpec.max_tokens={n} alone fills it, so no prompt limit fits) or "
            f"set SamplingSpec.max_tokens = {length - limit}"
            if length - limit >= 1
            else ""
        )
        out.append(
            f"RolloutConfig.max_model_len={length} is shorter than the prompt limit ({limit}) + "
            f"SamplingSpec.max_tokens={n}; set RolloutConfig.max_model_len = {limit + n}"
            f"{shorter}"
        )
    budget = cfg.rollout.whole_prefill_problem()  # on CPU the servers would refuse to start
    if budget and not float(dict(cfg.pools.get(cfg.rollout.pool, {})).get("GPU", 0)):
        out.append(budget)
    if cfg.sampling.top_p != 1.0 or cfg.sampling.top_k not in (0, -1):
        out.append(
            f"SamplingSpec.top_p={cfg.sampling.top_p} / top_k={cfg.sampling.top_k}: truncated "
            f"sampling makes the rollout's log-probs differ from the trainer's full-softmax "
            f"log-probs (off-policy without correction); use top_p=1.0, top_k=0 for RL"
        )
    return out


# config.json keys that hold a model's position limit, in the order vLLM reads them.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def model_positions(model_path: str) -> tuple[str, int] | None:
    """(config.json key, the longest sequence the model at ``model_path`` takes), as vLLM
    derives it (a RoPE scaling factor stretches it, except for the types that keep the
    original length); None when config.json names none."""
    import json
    from pathlib import Path

    config = json.loads(Path(model_path, "config.json").read_text())
    config = config.get("text_config") or config
    key = next((k for k in _POSITION_KEYS if isinstance(config.get(k), int)), None)
    if key is None:
        return None
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor", 1.0) if kind not in ("su", "longrope", "llama3") else 1.0
    if kind == "yarn" and "original_max_position_embeddings" in rope:
        return key, int(rope["original_max_position_embeddings"] * factor)
    return key, int(config[key] * factor)


def length_problems(cfg: RunConfig) -> list[str]:
    """The rollout's sequences fit the model: ``RolloutConfig.max_model_len`` (prompt +
    response) within the positions of ``RunConfig.model_path`` (vLLM refuses a longer
    one at start-up, after the workers started)."""
    found = model_positions(cfg.model_path)
    if found is None or cfg.rollout.max_model_len <= found[1]:
        return []
    key, positions = found
    r, n = cfg.rollout, cfg.sampling.max_tokens
    need = f"RolloutConfig.max_prompt_len ({r.prompt_limit}) + SamplingSpec.max_tokens ({n})"
    if r.prompt_limit + n <= positions:
        fix = f"set RolloutConfig.max_model_len = {positions}"
    elif n < positions:
        fix = (
            f"{need} = {r.prompt_limit + n} do not fit either: set RolloutConfig.max_model_len "
            f"= {positions} and RolloutConfig.max_prompt_len = {positions - n} (or lower "
            f"SamplingSpec.max_tokens)"
        )
    else:
        fix = (
            f"{need} = {r.prompt_limit + n} do not fit either: set SamplingSpec.max_tokens < "
            f"{positions}, RolloutConfig.max_model_len = {positions} and "
            f"RolloutConfig.max_prompt_len <= {positions} - max_tokens"
        )
    return [
        f"RolloutConfig.max_model_len={r.max_model_len} is longer than the model's {key}="
        f"{positions} ({cfg.model_path}/config.json): vLLM would refuse to start; {fix}, or "
        f"use a model with more positions"
    ]


def _placement_problems(cfg: RunConfig, spec: Any) -> list[str]:
    from polyrl.weight_sync import transport_problems

    out = []
    if spec.objective == "rl":  # which transports this placement supports
        out += transport_problems(
            cfg.weight_transport,
            cfg.actor.pool,
            cfg.rollout.pool,
            cfg.pools,
            cfg.rollout.tensor_parallel_size,
        )
        if cfg.weight_bucket_mb is not None and not cfg.weight_bucket_mb > 0:
            out.append(
                f"RunConfig.weight_bucket_mb={cfg.weight_bucket_mb} must be > 0 (MiB per weight-sync "
                f"bucket); leave it unbound (None) for the transport's default"
            )
    from polyrl.role_table import ROLE_TABLE, role_names

    for role in role_names(cfg, spec):
        own = cfg.role_config(role)
        if ROLE_TABLE[role].kind == "engine":
            out += own.problems(role)
        if own.pool not in cfg.pools:
            where = (
                f"polyrl.{type(own).__name__}.pool"  # RolloutConfig, JudgeConfig
                if ROLE_TABLE[role].kind == "rollout"
                else f"{ROLE_TABLE[role].config}/polyrl.RoleConfig.pool"
            )
            out.append(
                f"{where}={own.pool!r} ({role}) is not a pool in RunConfig.pools "
                f"({sorted(cfg.pools)})"
            )
    return out


def check_cluster(cfg: RunConfig) -> list[str]:
    """The machine and Ray environment: GPUs asked for exist, Ray address reachable."""
    out = []
    address = os.environ.get("RAY_ADDRESS")
    multi_node = any(int(r.get("nodes", 1)) > 1 for r in cfg.pools.values())
    # On a cluster (RAY_ADDRESS, or pools over several nodes) the placement checks each
    # pool against the nodes' resources when it starts; here only this machine's GPUs.
    want_gpus = sum(float(r.get("GPU", 0)) for r in cfg.pools.values())
    if want_gpus and not address and not multi_node:
        try:
            import torch

            have = torch.cuda.device_count()
        except ImportError:
            have = 0
        if have < want_gpus:
            out.append(
                f"RunConfig.pools asks for {want_gpus:g} GPUs but this machine has {have}; set "
                f"the pools' 'GPU' to 0 to run on CPU, or run on a GPU machine"
            )
    if address and address not in ("auto", "local") and ":" not in address:
        out.append(
            f"RAY_ADDRESS={address!r} is not host:port, 'auto' or 'local'; unset it for a local cluster"
        )
    elif address and address not in ("auto", "local"):
        from polyrl.cluster.doctor import unreachable

        problem = unreachable(address)
        out += [problem] if problem else []
    return out


def check_run(cfg: RunConfig, spec: Any, cluster: bool = True) -> list[str]:
    """Every problem with ``cfg`` for algorithm ``spec`` (empty list: good to go)."""
    from polyrl.backends.base import ENGINES

    problems = []
    if cfg.backend not in ENGINES:
        problems.append(
            f"RunConfig.backend={cfg.backend!r} is not a registered backend; choose one of "
            f"{sorted(ENGINES)} (include gin/backends/<name>.gin)"
        )
    problems += _batch_problems(cfg, spec)
    problems += check_validation(cfg, spec)
    if spec.objective == "rl":
        problems += _rollout_problems(cfg)
    problems += _placement_problems(cfg, spec)
    if cfg.backend in ENGINES:
        from polyrl.cluster.roles import build_roles, role_problems

        try:
            problems += role_problems(cfg, build_roles(cfg, spec))
        except ValueError as e:  # a field the roles are built from, already named
            problems += [str(e)] if str(e) not in " ".join(problems) else []
    problems += async_problems(cfg, spec)
    if cluster:
        problems += check_cluster(cfg)
    return problems


# ---------------------------------------------------------------- role isolation
def _spec(cfg: RunConfig, problems: list[str]) -> Any:
    from polyrl.algos import algorithm_names, get_algorithm
    from polyrl.config import did_you_mean

    if cfg.algorithm not in algorithm_names():
        problems.append(
            f"RunConfig.algorithm={cfg.algorithm!r} is not a registered algorithm; choose one of "
            f"{algorithm_names()}{did_you_mean(cfg.algorithm, algorithm_names())}"
        )
        return None
    spec = get_algorithm(cfg.algorithm)
    import dataclasses

    fields = [f.name for f in dataclasses.fields(spec)]
    unknown = [k for k in cfg.algo_overrides if k not in fields]
    for key in unknown:
        problems.append(
            f"RunConfig.algo_overrides[{key!r}]: AlgorithmSpec has no field {key!r}"
            f"{did_you_mean(key, fields) or f'; valid: {sorted(fields)}'}"
        )
    if unknown:
        return None
    try:
        return spec.replace(**dict(cfg.algo_overrides))
    except (ValueError, TypeError) as e:
        problems.append(f"RunConfig.algo_overrides={dict(cfg.algo_overrides)}: {e}")
        return None


def isolation_problems(cfg: RunConfig, spec: Any) -> list[str]:
    """Pitfall 1: a KL term needs the reference; a reward model needs a score head; LoRA
    needs an actor to adapt."""
    out = []
    if cfg.lora is not None and not spec.needs_actor:
        out.append(
            f"RunConfig.lora={cfg.lora!r} is set but algorithm {spec.name!r} trains no actor: "
            f"LoRA adapts the actor only and its critic (the reward model) trains every "
            f"weight; unbind it (polyrl.RunConfig.lora = None) to train the critic in full"
        )
    over = cfg.algo_overrides
    for coef, switch in (("kl_loss_coef", "use_kl_loss"), ("kl_coef", "kl_in_reward")):
        if coef in over and over[coef] and not getattr(spec, switch):
            out.append(
                f"RunConfig.algo_overrides sets {coef}={over[coef]!r} but {spec.name!r} has "
                f"{switch}=False, so no reference model is built and the KL term is never "
                f"applied; add {switch!r}: True to algo_overrides or remove {coef!r}"
            )
    path = cfg.reward_model.model_path
    if path and spec.objective == "rl":
        try:
            head = score_head(path)
        except (OSError, ValueError) as e:  # unreadable config.json / safetensors header
            head = f"cannot be read ({e})"
        if head is not None:
            out.append(
                f"reward_model/polyrl.RoleConfig.model_path={path!r} {head}: the reward_model "
                f"role reads one score per sequence; pass a checkpoint saved by "
                f"AutoModelForSequenceClassification (num_labels=1)"
            )
    return out


def judge_problems(cfg: RunConfig, spec: Any) -> list[str]:
    """An LLM judge (``RunConfig.judge``) scores single-turn RL responses."""
    from polyrl.loop.judge import JudgeConfig

    if cfg.judge is None:
        return []
    if not isinstance(cfg.judge, JudgeConfig):
        return [f"RunConfig.judge={cfg.judge!r} must be @polyrl.JudgeConfig() or None"]
    if spec.objective != "rl":
        return [
            f"RunConfig.judge is set but {spec.name!r} ({spec.objective}) scores no "
            "responses; unbind RunConfig.judge"
        ]
    if cfg.episodes is not None:
        return [
            "RunConfig.judge is set with RunConfig.episodes: episodes are scored by their "
            "envs; unbind one of them"
        ]
    if cfg.judge.model_path is not None:
        return _own_judge_problems(cfg, spec)
    if cfg.max_staleness or cfg.streaming:
        return [
            f"RunConfig.judge asks the rollout pool at the reward stage, which must then be "
            f"idle, but max_staleness={cfg.max_staleness} / streaming={cfg.streaming} "
            "generate while the trainer rewards; set max_staleness = 0 and streaming = False, "
            "or give the judge servers of its own (JudgeConfig.model_path)"
        ]
    return []


def _own_judge_problems(cfg: RunConfig, spec: Any) -> list[str]:
    """A judge on servers of its own (``JudgeConfig.model_path``): a model directory with
    a tokenizer and a chat template (its requests are rendered with them). Its pool is
    never asked by generation, so rollouts may run ahead and stream (every judgement
    is asked by the trainer's thread), except ReMax's greedy baseline: it is rewarded
    where the batch is generated, ahead in a thread of its own with max_staleness."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = cfg.judge.model_path
    where = f"JudgeConfig.model_path={path!r}"
    if not Path(path, "config.json").is_file():
        return [f"{where} has no config.json; pass a local Hugging Face model directory"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        return [f"{where}: its tokenizer cannot be loaded ({e}); save one with the model"]
    if not tokenizer.chat_template:
        return [
            f"{where}: its tokenizer has no chat template (the judge's requests are chat "
            "messages); use an instruct/chat model or set tokenizer.chat_template and save it"
        ]
    if spec.needs_greedy_baseline and cfg.max_staleness:
        return [
            f"RunConfig.judge with max_staleness={cfg.max_staleness}: {spec.name!r} rewards "
            "its greedy baseline while generating ahead, beside the step's judgements on the "
            "same judge servers; set max_staleness = 0"
        ]
    return []


def score_head(path: str) -> str | None:
    """Why the checkpoint at ``path`` has no usable score head (None: it has one)."""
    import json
    import struct
    from pathlib import Path

    config = json.loads(Path(path, "config.json").read_text())
    archs = config.get("architectures") or []
    if any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs):
        labels = config.get("num_labels", len(config.get("id2label") or {}) or 1)
        return None if labels == 1 else f"has num_labels={labels} (one score is needed)"
    for file in Path(path).glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        if any(
            k.endswith(("score.weight", "value_head.weight", "v_head.summary.weight"))
            for k in header
        ):
            return None
    return f"is a {'/'.join(archs) or 'model'} checkpoint with no score head (config.json architectures)"


# ---------------------------------------------------------------- the distillation teacher
TEACHER_PATH = "teacher/polyrl.RoleConfig.model_path"


def teacher_problems(cfg: RunConfig, spec: Any) -> list[str]:
    """The teacher is bound exactly when the algorithm reads it, is a model directory,
    and tokenizes as the student (``RunConfig.model_path``, already resolved): its
    log-probs score the student's token ids."""
    from pathlib import Path

    path = cfg.teacher.model_path
    needed = spec.objective == "rl" and spec.needs_teacher
    if path is None:
        if not needed:
            return []
        return [
            f"{TEACHER_PATH} is None but algorithm {spec.name!r} scores the student's tokens "
            f"with a teacher; set it to a local Hugging Face causal LM directory that shares "
            f"the student's tokenizer (gin/algos/distillation.gin)"
        ]
    if not needed:
        return [
            f"{TEACHER_PATH}={path!r} is set but algorithm {spec.name!r} reads no teacher, so "
            f"it would never run; use RunConfig.algorithm = 'distillation' or unbind it"
        ]
    if not Path(path, "config.json").exists():
        return [f"{TEACHER_PATH}={path!r} has no config.json; pass a local Hugging Face model"]
    try:
        differences = tokenizer_differences(cfg.model_path, path)
    except (OSError, ValueError) as e:
        return [f"{TEACHER_PATH}={path!r}: its tokenizer cannot be loaded ({e})"]
    if not differences:
        return []
    return [
        f"{TEACHER_PATH}={path!r} does not tokenize as the student (RunConfig.model_path="
        f"{cfg.model_path!r}), so its log-probs would score other tokens than the student "
        f"sampled: {'; '.join(differences)}. Use a teacher of the student's tokenizer (the "
        f"same model family, or a checkpoint trained from the student's)"
    ]


def tokenizer_differences(student: str, teacher: str, shown: int = 3) -> list[str]:
    """How the tokenizers of two model directories differ, as ``field: student vs
    teacher`` lines (empty: they map every token to the same id): the vocabulary size,
    each special token and its id, and the first ``shown`` ids whose token differs."""
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    out = []
    if len(a) != len(b):
        out.append(f"vocabulary size: {len(a)} vs {len(b)}")
    for name in sorted(set(a.SPECIAL_TOKENS_ATTRIBUTES) - {"additional_special_tokens"}):
        pair = [(getattr(t, name), getattr(t, f"{name}_id")) for t in (a, b)]
        if pair[0] != pair[1]:
            (ta, ia), (tb, ib) = pair
            out.append(f"{name}: {ta!r} (id {ia}) vs {tb!r} (id {ib})")
    ids_a = {i: tok for tok, i in a.get_vocab().items()}
    ids_b = {i: tok for tok, i in b.get_vocab().items()}
    differ = sorted(i for i in ids_a.keys() | ids_b.keys() if ids_a.get(i) != ids_b.get(i))
    if differ:
        listed = ", ".join(f"{i}: {ids_a.get(i)!r} vs {ids_b.get(i)!r}" for i in differ[:shown])
        out.append(f"{len(differ)} ids map to other tokens (id: student vs teacher), e.g. {listed}")
    return out


# ---------------------------------------------------------------- placement by hand
_DEVICE_KEYS = ("devices", "device_ids", "gpu_ids", "cuda_visible_devices")
_RESOURCE_NAMES = {"gpu": "GPU", "gpus": "GPU", "num_gpus": "GPU", "cpu": "CPU", "cpus": "CPU"}


def device_problems(cfg: RunConfig) -> list[str]:
    """Pitfall 3: device ids chosen by hand, and rollout tensor-parallel groups."""
    out = []
    reason = (
        "Ray assigns each worker its GPUs and sets CUDA_VISIBLE_DEVICES per worker; ids set "
        "by hand bypass its accounting, so roles land on the same GPU or none"
    )
    env = dict(cfg.rollout.env) if cfg.rollout is not None else {}
    if "CUDA_VISIBLE_DEVICES" in env:
        out.append(
            f"RolloutConfig.env sets CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}: "
            f"{reason}; remove it and size RunConfig.pools instead"
        )
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and os.environ.get("RAY_ADDRESS"):
        out.append(
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} is set on the driver "
            f"while RAY_ADDRESS names a cluster: it has no effect on the cluster's nodes and "
            f"{reason}; unset it"
        )
    for name, res in cfg.pools.items():
        for key in res:
            if key not in ("GPU", "CPU") and key.lower() in _RESOURCE_NAMES:
                out.append(
                    f"RunConfig.pools[{name!r}][{key!r}]: Ray calls this resource "
                    f"{_RESOURCE_NAMES[key.lower()]!r} (a {key!r} key would be a custom resource "
                    f"no node has); rename it"
                )
            if key.lower() in _DEVICE_KEYS:
                out.append(
                    f"RunConfig.pools[{name!r}][{key!r}]={res[key]!r}: device ids cannot be "
                    f"chosen by hand ({reason}); give the pool a count, e.g. {{'GPU': 2}}"
                )
    if cfg.rollout is not None and cfg.rollout.pool in cfg.pools:
        from polyrl.cluster.roles import pool_shape

        pool = cfg.rollout.pool
        shape = pool_shape(cfg.pools[pool])
        gpus, total = int(shape.gpus), int(shape.gpus) * shape.nodes
        tp, servers = cfg.rollout.tensor_parallel_size, cfg.rollout.num_servers
        if gpus and gpus % tp:
            divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
            out.append(
                f"RolloutConfig.tensor_parallel_size={tp} does not divide pool {pool!r} "
                f"({gpus} GPUs per node): {gpus} % {tp} = {gpus % tp} GPUs would idle and a "
                f"group cannot leave its node; use one of {divisors}"
            )
        elif gpus and servers * tp > total:
            out.append(
                f"RolloutConfig.num_servers={servers} x tensor_parallel_size={tp} = "
                f"{servers * tp} GPUs, but pool {pool!r} has {total}; set num_servers = "
                f"{total // tp}"
            )
    return out


# ---------------------------------------------------------------- datasets
LIMIT_BINDING = "RolloutConfig.max_prompt_len"  # the binding that holds the prompt limit


def row_limit(cfg: RunConfig, spec: Any) -> tuple[int | None, str]:
    """The longest row in tokens and the binding that holds it: the prompt limit, or for
    SFT (whole conversations) ``RolloutConfig.max_model_len``."""
    if cfg.rollout is None:
        return None, LIMIT_BINDING
    if spec.objective == "sft":
        return cfg.rollout.max_model_len, "RolloutConfig.max_model_len"
    return cfg.rollout.prompt_limit, LIMIT_BINDING


def dataset_problems(
    cfg: RunConfig, spec: Any, tokenizer: Any, samples: dict | None = None
) -> tuple[list[str], list[str], int]:
    """Pitfall 4: the configured data files exist, parse and pass validate-dataset for the
    algorithm's schema; the overlong policy acts before the limit rejects anything; the
    data covers a step; each data_source's reward scores a few of its rows
    (:func:`reward_problems`; with ``samples`` given, those rows are put there to be
    scored later instead). Returns (problems, warnings, rows that train)."""
    from polyrl.data.schema import DatasetError, validate_rows
    from polyrl.data.schema import load_rows as load
    from polyrl.data.tasks import MAKERS, TASKS

    kind = spec.data_kind  # the row kind of polyrl.data.schema.KINDS
    overlong = cfg.rollout.overlong_prompt if cfg.rollout is not None else "error"
    limit, limit_name = row_limit(cfg, spec)
    problems, warnings, rows, dropped, longest = [], [], 0, 0, 0
    deferred, samples = samples is not None, {} if samples is None else samples
    files = {"RunConfig.train_files": tuple(cfg.train_files)}
    for name in ("val_files", "eval_files"):
        if getattr(cfg, name, None):
            files[f"RunConfig.{name}"] = tuple(getattr(cfg, name))
    if not cfg.train_files and cfg.task not in TASKS:
        return [f"RunConfig.task={cfg.task!r} is not a task; use one of {sorted(TASKS)}"], [], 0
    if not cfg.train_files:  # a built-in task: its rows are checked the same way
        files["RunConfig.task"] = (f"task {cfg.task} (train)",)
    make = MAKERS[kind]
    for binding, paths in files.items():
        for path in paths:
            try:
                if binding == "RunConfig.task":
                    data, lines, unread = make(cfg.task, cfg.n_train_prompts, cfg.seed), None, []
                else:
                    data, lines, unread = load(path)
                report = validate_rows(
                    data, path, tokenizer, limit, kind, lines, overlong, limit_name, unread
                )
            except DatasetError as e:
                problems += [f"{binding}: {path}: {p}" for p in e.problems]
                continue
            for i, row in enumerate(data if kind == "rl" else ()):
                if len(found := samples.setdefault(row["data_source"], [])) < REWARD_ROWS:
                    found.append((f"{binding}: {path}", i, row))
            if report.over_limit:
                verb = "dropped" if overlong == "drop" else "truncated"
                warnings.append(
                    f"{binding}: {path}: {report.over_limit} of {report.n_rows} prompts are over "
                    f"the prompt limit ({limit} tokens) and will be {verb} "
                    f"(RolloutConfig.overlong_prompt={overlong!r})"
                )
            problems += source_problems(cfg, binding, path, report.data_sources)
            if binding in ("RunConfig.train_files", "RunConfig.task"):
                rows += report.n_rows
                dropped += report.over_limit if report.kept is not None else 0
                longest = max(longest, report.max_prompt_tokens or 0)
    if not problems and rows and rows == dropped:
        where = (
            f"RunConfig.train_files={list(cfg.train_files)}"
            if cfg.train_files
            else f"RunConfig.task={cfg.task!r}"
        )
        problems.append(
            f"every one of the {rows} training prompts ({where}) is over {LIMIT_BINDING}="
            f"{limit} tokens, and RolloutConfig.overlong_prompt='drop' leaves none to train "
            f"on: raise {LIMIT_BINDING} (the longest prompt is {longest} tokens), shorten the "
            f"prompts or set overlong_prompt='truncate_left'"
        )
    problems += [] if deferred else reward_problems(samples, cfg.reward_timeout_s)
    rows -= dropped
    if not problems and rows < cfg.prompts_per_step:
        where = "RunConfig.train_files" if cfg.train_files else "RunConfig.n_train_prompts"
        after = f" left after overlong_prompt='drop' removed {dropped}" if dropped else ""
        problems.append(
            f"RunConfig.prompts_per_step={cfg.prompts_per_step} exceeds the {rows} training "
            f"rows{after} ({where}): a step cannot be filled; set prompts_per_step <= {rows}, "
            f"add data{' or raise RolloutConfig.max_prompt_len' if dropped else ''}"
        )
    return problems, warnings, rows


REWARD_ROWS = 2  # rows of each data_source that reward_problems scores


def reward_problems(
    samples: dict[str, list[tuple[str, int, Any]]], timeout_s: float | None
) -> list[str]:
    """Each data_source's reward function, called on a few of its rows (data_source ->
    [(file, index, row)]) with the ground truth as the response and with an empty
    response, before any worker starts: a crash, a hang past ``timeout_s`` or a value
    that is not one finite float is named (the data_source, the function, the fix), one
    problem per data_source. ``breakpoint()`` calls in a reward are skipped here (they
    are meant for the reward workers, docs/debugging.md)."""
    import sys

    from polyrl.rewards.registry import REWARDS
    from polyrl.rewards.workers import RewardError, score_items

    out, hook = [], sys.breakpointhook
    sys.breakpointhook = lambda *args, **kwargs: None
    try:
        for source, rows in samples.items():
            tries = [(f, i, row, t) for f, i, row in rows for t in (row["ground_truth"], "")]
            for where, i, row, text in tries if source in REWARDS else ():
                item = (i, text, row["ground_truth"], source, row.get("extra_info"))
                try:
                    score_items(REWARDS, [item], timeout_s)
                except RewardError as e:
                    what = "the ground truth as the response" if text else "an empty response"
                    out.append(f"{where}: row {i} scored with {what}: {e}")
                    break
    finally:
        sys.breakpointhook = hook
    return out


def source_problems(cfg: RunConfig, binding: str, path: str, sources: Any) -> list[str]:
    """A multi-turn run's rows need an environment for their data_source, a single-turn
    run's a reward function (docs/agents.md)."""
    from polyrl.envs import AGENTS, ENVS
    from polyrl.rewards import REWARDS

    played = {**ENVS, **AGENTS}  # an OpenAI-client agent plays its rows like an env
    need, fix = (
        (played, "register one with polyrl.envs.register_env or unset RunConfig.episodes")
        if cfg.episodes is not None
        else (REWARDS, "register a reward, or set RunConfig.episodes to play them as episodes")
    )
    kind = "environment" if need is played else "reward function"
    out = [
        f"{binding}: {path}: data_source {s!r} has no {kind} ({sorted(need)}); {fix}"
        for s in sorted(sources)
        if s in played or s in REWARDS
        if s not in need
    ]
    if cfg.episodes is not None:  # each env's tools and parser
        from polyrl.envs import env_problems

        out += [p for s in sorted(sources) if s in ENVS for p in env_problems(s)]
    return out


def episode_problems(cfg: RunConfig, spec: Any) -> list[str]:
    """RunConfig.episodes against the rollout, the sampling, the model and the algorithm."""
    import json
    from pathlib import Path

    ep = cfg.episodes
    if ep is None:
        return []
    out = []
    if cfg.rollout.engine == "sync":
        out.append(
            f"RolloutConfig.engine={cfg.rollout.engine!r}: RunConfig.episodes runs every "
            f"episode's turns in flight together, which needs the asynchronous engine; set "
            f"RolloutConfig.engine = 'async' (the default)"
        )
    if ep.max_episode_tokens > cfg.rollout.max_model_len:
        out.append(
            f"EpisodeConfig.max_episode_tokens={ep.max_episode_tokens} is more than "
            f"RolloutConfig.max_model_len={cfg.rollout.max_model_len}: raise max_model_len "
            f"or lower max_episode_tokens"
        )
    if cfg.sampling.max_tokens >= ep.max_episode_tokens:
        out.append(
            f"SamplingSpec.max_tokens={cfg.sampling.max_tokens} (one turn) is not below "
            f"EpisodeConfig.max_episode_tokens={ep.max_episode_tokens} (the whole episode); "
            f"lower max_tokens or raise max_episode_tokens"
        )
    config = Path(str(cfg.model_path), "config.json")
    positions = (
        json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
    )
    if positions is not None and ep.max_episode_tokens > positions:
        out.append(
            f"EpisodeConfig.max_episode_tokens={ep.max_episode_tokens} is more than the "
            f"model's max_position_embeddings={positions}; lower max_episode_tokens"
        )
    for field, on in (
        ("reward_model/polyrl.RoleConfig.model_path", cfg.reward_model.model_path is not None),
        ("RunConfig.algorithm (ReMax's greedy baseline)", spec.needs_greedy_baseline),
        ("RunConfig.algo_overrides overlong_buffer_len", bool(spec.overlong_buffer_len)),
    ):
        if on:
            out.append(
                f"{field} is not supported with RunConfig.episodes (an episode's "
                f"reward comes from its env); unset one of them"
            )
    return out


def preflight(
    cfg: RunConfig, reward_rows: dict | None = None
) -> tuple[RunConfig, Any, list[str], list[str]]:
    """Every check before anything starts: (filled config, algorithm spec, warnings,
    the batch arithmetic lines). ConfigError lists every problem. ``reward_rows``: put
    the rows :func:`reward_problems` scores there instead of scoring them now (polyrl
    train scores them once Ray runs, before any worker: a reward may start Ray tasks)."""
    import dataclasses
    from pathlib import Path

    problems: list[str] = []
    spec = _spec(cfg, problems)
    model_path = cfg.model_path
    if model_path is None:
        from polyrl.data.tiny import ensure_tiny_model

        try:
            model_path = str(ensure_tiny_model(Path(cfg.run_dir) / "models", cfg.tiny_model))
        except OSError as e:
            raise ConfigError(
                problems
                + [
                    f"RunConfig.run_dir={cfg.run_dir!r} is not writable ({e}); choose "
                    f"a directory you can write"
                ]
            ) from None
    elif not Path(model_path, "config.json").exists():
        problems.append(
            f"RunConfig.model_path={model_path!r} has no config.json; pass a local Hugging Face "
            f"model directory"
        )
    reward_model = cfg.reward_model.model_path
    if reward_model is not None and not Path(reward_model, "config.json").exists():
        problems.append(
            f"reward_model/polyrl.RoleConfig.model_path={reward_model!r} has no config.json; "
            f"pass a local sequence-classification model directory"
        )
    raise_if_problems(problems)
    rollout = dataclasses.replace(cfg.rollout, model_path=model_path)
    cfg = dataclasses.replace(cfg, model_path=model_path, rollout=rollout)
    problems = check_run(cfg, spec) + isolation_problems(cfg, spec) + device_problems(cfg)
    problems += teacher_problems(cfg, spec)
    if spec.objective == "rl":
        problems += length_problems(cfg)
    problems += episode_problems(cfg, spec) + judge_problems(cfg, spec)
    from polyrl.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_path, cfg.cache_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(
            problems
            + [f"RunConfig.model_path={model_path!r}: its tokenizer cannot be loaded ({e})"]
        ) from None
    data_problems, warnings, rows = dataset_problems(cfg, spec, tokenizer, reward_rows)
    raise_if_problems(problems + data_problems)
    return cfg, spec, warnings, batch_arithmetic(cfg, spec, rows)
