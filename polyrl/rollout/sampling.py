"""What to sample (:class:`SamplingSpec`) and how the rollout servers run (:class:`RolloutConfig`).

Both are frozen dataclasses built on the driver and sent to the servers (docs/design.md
"Configuration"). Neither imports vLLM: the servers turn a spec into vLLM
``SamplingParams`` themselves (:meth:`SamplingSpec.vllm_kwargs`).

Log-probability convention
--------------------------
The servers run vLLM with ``logprobs_mode="processed_logprobs"``, so the log-prob
reported for a sampled token is that of the distribution it was drawn from:
``log_softmax(mask(logits) / temperature)`` after top-k/top-p, where ``mask`` sets
the logits of ids the sampler may not emit to ``-inf`` (or lowers them by 100, which is
the same in fp32: ``polyrl.rollout.server.vocab_mask``). The trainer computes
``log_softmax(logits / temperature)``; the two agree exactly when

* ``top_k`` and ``top_p`` are off (``top_k=0``, ``top_p=1``; the RL default), and
* the trainer applies the same vocabulary mask: logits of ids
  ``>= Batch.info["sampling_vocab_size"]`` set to ``-inf`` (equivalently, a
  log-softmax over ``logits[..., :sampling_vocab_size]``). Models whose embedding is
  padded past the tokenizer (Qwen2 checkpoints, the tiny test model: 64 rows, 58
  tokens) would otherwise sample ids the tokenizer cannot decode.

With ``temperature=0`` (greedy) vLLM reports ``log_softmax(mask(logits))``, i.e.
temperature 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from polyrl.config import did_you_mean
from polyrl.errors import raise_if_problems
from polyrl.role_table import DEFAULT_POOL

__all__ = ["SamplingSpec", "RolloutConfig", "ENGINES", "OVERLONG_POLICIES", "derive_seed"]

OVERLONG_POLICIES = ("error", "truncate_left", "drop")
ENGINES = ("async", "sync")
_SEED_MOD = 2**31 - 1


def derive_seed(seed: int, sample_index: int) -> int:
    """The per-request seed of sample ``sample_index`` (row of the repeated batch).

    It depends only on the spec's seed and the sample's global index, so a sample's
    tokens do not depend on how the batch was split across servers.
    """
    return (seed * 1_000_003 + sample_index) % _SEED_MOD


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """One generate call's sampling settings.

    n: samples per prompt (rows ``i*n .. i*n+n-1`` of the output belong to prompt ``i``).
    temperature: 0 means greedy.
    top_p, top_k: nucleus / top-k filtering; ``top_p=1`` and ``top_k=0`` turn them off.
      Keep them off for on-policy RL: with them on, the reported (processed) log-probs
      are those of the truncated distribution, which the trainer does not compute.
    max_tokens: response length cap (the response width R of the output batch).
    stop_token_ids: extra ids that end a response (the tokenizer's EOS always does
      unless ``ignore_eos``); the stop token is kept as the last response token.
    seed: base seed; None draws fresh randomness every call (not reproducible).
    ignore_eos: keep generating past EOS (benchmarks).
    detokenize: also return each response's text (meta ``response_text``), decoded once
      per response by the server (``skip_special_tokens``), not token by token inside
      vLLM's engine loop (a response cut inside a multi-byte character ends in U+FFFD).
    prompt_logprobs: also return each prompt token's log-prob given the tokens before it
      (``RolloutServer.generate``'s ``prompt_log_probs``; the Tinker API's
      ``compute_logprobs``, ``polyrl.service``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = 0
    ignore_eos: bool = False
    detokenize: bool = True
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = (
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0 (0 = greedy)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1] (1 = off)"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, "must be >= 0 (0 or -1 = off)"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
        )
        raise_if_problems(
            [
                f"SamplingSpec.{field}={getattr(self, field)!r} {rule}"
                for field, ok, rule in checks
                if not ok
            ]
        )

    def vllm_kwargs(self, sample_index: int, vocab_mask: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams`` for one sample (n=1 per request);
        ``vocab_mask``: the server's (``polyrl.rollout.server.vocab_mask``)."""
        return dict(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            seed=None if self.seed is None else derive_seed(self.seed, sample_index),
            ignore_eos=self.ignore_eos,
            # vLLM's engine loop detokenizes every new token of every request (and names
            # each log-prob's token) when asked: host time per decode step. The server
            # decodes each response once instead (RolloutServer.generate).
            detokenize=False,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,  # flat lists, not a dict and a Logprob object per token
            prompt_logprobs=0 if self.prompt_logprobs else None,  # the prompt's own tokens
            skip_special_tokens=True,
            # Each request gets SamplingParams of its own (server.vllm_requests): vLLM's
            # defensive deep copy of them per request is waste (with 151k allowed ids it
            # took 40 ms a request).
            skip_clone=True,
            **vocab_mask,
        )


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The rollout servers of one run.

    model_path: HF directory the servers start from (the actor's initial weights).
    num_servers: independent vLLM engines; a batch is split across them.
    tensor_parallel_size: GPUs per server (GPU only; 1 on CPU).
    dtype: "float32" for parity tests; "auto" keeps the checkpoint dtype except that
      vLLM casts fp32 checkpoints to bf16; "bfloat16"/"float16" force it.
    max_model_len: prompt + response tokens per sequence.
    max_prompt_len: longest accepted prompt; None means ``max_model_len - 1``.
    overlong_prompt: what to do with a longer prompt: "error" (raise, naming the sample
      index and length), "truncate_left" (keep the last ``max_prompt_len`` tokens) or
      "drop" (leave the prompt out; the output's ``info["dropped"]`` lists its index).
    restrict_to_tokenizer: sample only ids the tokenizer has (see the module
      docstring for what the trainer must do); no effect when the model's vocabulary
      is not larger than the tokenizer's.
    kv_cache_gib: KV-cache size on CPU (vLLM's default sizing fails on some hosts).
    gpu_memory_utilization: fraction of each GPU vLLM may take (colocated: leave room
      for the trainer).
    gpu_kv_cache_gib: the KV cache of each server on GPUs, in GiB (vLLM's
      ``kv_cache_memory_bytes``), instead of what ``gpu_memory_utilization`` leaves after
      vLLM's memory profile. The profile reads the whole device's free memory, so GPU
      memory that colocated role workers take while the server starts (a 7B actor
      loading its 14 GiB of weights) is counted as the server's and taken from its cache
      (docs/rollout.md "Start-up"); a size given here does not move. None: profiled.
      On CPU ``kv_cache_gib`` applies.
    enable_sleep_mode: let :meth:`RolloutPool.sleep` free GPU memory (GPU only; vLLM
      rejects it on CPU).
    enforce_eager: None -> eager on CPU (starts in ~3 s, not 20-50 s), graphs on GPU.
    engine: "async" (the default, every run's: vLLM's ``AsyncLLM``, whole batches and
      many episodes' requests in flight at once; its engine core is always a process of
      its own) or "sync" (``vllm.LLM``, one batch per call; single-turn only), which
      sampled the GRPO experiment's batches as fast on one H100 at the scheduler limits
      polyrl sets for both. docs/rollout.md "Engines".
    continue_in_place: a weight push pauses the requests in flight instead of waiting
      for them to end: they keep their KV cache, take the new weights and go on, so
      their later tokens are sampled by the new version (each result's
      ``token_versions`` says which token came from which). Needs ``engine="async"``;
      used by ``RunConfig.streaming`` (docs/training.md "Streaming and partial rollouts").
    in_process_engine: run the synchronous engine's core in the server's process
      (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); weights then reach the workers as tensors.
    num_cpus / num_gpus: Ray resources per server (None: 0.5 CPU on CPU hosts, 1 CPU
      with GPUs; ``tensor_parallel_size`` GPUs when a GPU is present).
    max_restarts: how often Ray restarts a dead server before the pool gives up on it.
    ready_timeout_s: how long to wait for a server to start before failing with a
      placement/start-up error instead of hanging.
    request_timeout_s: per generate call of one server.
    max_num_seqs / max_num_batched_tokens: the engine's scheduler limits, requests sampled
      together and tokens one engine step takes. None: what ``vllm.LLM`` picks on the
      server's device (1024 and 16384 on an H100 or H200, 256 and 4096 on CPU), for both
      engines alike (vLLM's ``AsyncLLM`` alone would take 128 and 2048). Each server
      reads back the limits its engine runs at (``RolloutPool.infos``). On CPU every
      prefill runs whole, so ``max_num_batched_tokens`` must be >= ``max_model_len``.
    seed: engine seed (sampling uses per-request seeds from SamplingSpec.seed).
    env: extra environment variables for the server processes (``runtime_env``).
    pool: the ``RunConfig.pools`` entry the servers run in (the engine roles' is their
      ``RoleConfig.pool``); in the actor's pool they are colocated with it.
    """

    model_path: str | None
    num_servers: int = 1
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int = 1024
    max_prompt_len: int | None = None
    overlong_prompt: str = "error"
    restrict_to_tokenizer: bool = True
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    gpu_kv_cache_gib: float | None = None
    enable_sleep_mode: bool = False
    enforce_eager: bool | None = None
    in_process_engine: bool = True
    num_cpus: float | None = None
    num_gpus: float | None = None
    max_restarts: int = 3
    ready_timeout_s: float = 300.0
    request_timeout_s: float = 3600.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    seed: int = 0
    env: tuple[tuple[str, str], ...] = ()
    pool: str = DEFAULT_POOL
    engine: str = "async"
    continue_in_place: bool = False

    def __post_init__(self) -> None:
        out = []
        if self.overlong_prompt not in OVERLONG_POLICIES:
            out.append(
                f"RolloutConfig.overlong_prompt={self.overlong_prompt!r} is not one of "
                f"{list(OVERLONG_POLICIES)}{did_you_mean(self.overlong_prompt, OVERLONG_POLICIES)}"
            )
        if self.engine == "auto":  # a choice that went (issue 46): say what replaced it
            out.append(
                "RolloutConfig.engine='auto' is gone: every run takes the asynchronous engine, "
                "which sampled as fast as the synchronous one (docs/rollout.md 'Engines'); "
                "remove the binding, or bind 'sync' for vllm.LLM"
            )
        elif self.engine not in ENGINES:
            out.append(
                f"RolloutConfig.engine={self.engine!r} is not one of {list(ENGINES)}"
                f"{did_you_mean(self.engine, ENGINES)}"
            )
        if self.continue_in_place and self.engine == "sync":
            out.append(
                "RolloutConfig.continue_in_place=True pauses requests in flight during a "
                f"weight push, which RolloutConfig.engine={self.engine!r} cannot do; set "
                "RolloutConfig.engine='async'"
            )
        out += [
            f"RolloutConfig.{field}={getattr(self, field)} must be >= 1"
            for field in ("num_servers", "tensor_parallel_size")
            if getattr(self, field) < 1
        ]
        out += [
            f"RolloutConfig.{field}={getattr(self, field)} must be >= 1, or None for what "
            "vllm.LLM picks on the server's device"
            for field in ("max_num_seqs", "max_num_batched_tokens")
            if getattr(self, field) is not None and getattr(self, field) < 1
        ]
        if self.gpu_kv_cache_gib is not None and self.gpu_kv_cache_gib <= 0:
            out.append(
                f"RolloutConfig.gpu_kv_cache_gib={self.gpu_kv_cache_gib} must be > 0 (GiB of "
                f"KV cache a server), or None to size it from gpu_memory_utilization"
            )
        if self.max_model_len < 2:
            out.append(
                f"RolloutConfig.max_model_len={self.max_model_len} must be >= 2 (prompt + "
                f"response tokens, e.g. 1024)"
            )
        elif not 0 < self.prompt_limit < self.max_model_len:
            out.append(
                f"RolloutConfig.max_prompt_len={self.max_prompt_len} must be in "
                f"[1, max_model_len={self.max_model_len}); raise max_model_len or set "
                f"max_prompt_len between 1 and {self.max_model_len - 1}"
            )
        raise_if_problems(out)
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in dict(self.env).items()))

    @property
    def asynchronous(self) -> bool:
        """The servers run the asynchronous engine (``engine="async"``)."""
        return self.engine == "async"

    def whole_prefill_problem(self) -> str | None:
        """What is wrong with ``max_num_batched_tokens`` on CPU, where every prefill runs
        whole in one engine step (``polyrl.rollout.server.engine_kwargs``), or None."""
        budget = self.max_num_batched_tokens
        if budget is None or budget >= self.max_model_len:
            return None
        return (
            f"RolloutConfig.max_num_batched_tokens={budget} is below RolloutConfig.max_model_len="
            f"{self.max_model_len}: on CPU every prefill runs whole in one engine step, so a "
            f"step must hold the longest sequence; set it >= {self.max_model_len} or leave it None"
        )

    @property
    def prompt_limit(self) -> int:
        """The longest accepted prompt, in tokens."""
        return self.max_model_len - 1 if self.max_prompt_len is None else self.max_prompt_len
