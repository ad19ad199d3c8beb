"""RolloutPool: k rollout servers behind one ``generate``, with weight sync and recovery.

Input of :meth:`RolloutPool.generate`: a :class:`~polyrl.batch.Batch` with the meta
column ``prompt_ids`` (one ``list[int]`` per prompt: the chat-templated prompt the
trainer tokenized). Its other columns (ground truths, task ids, ...) are carried along.

Output: the input rows repeated ``n`` times in a row (``Batch.repeat``: rows
``i*n .. i*n+n-1`` are prompt ``i``'s samples, ``group_ids`` says which prompt) with
the sequence columns of :func:`polyrl.batch.from_token_lists` (``prompts``,
``responses``, ``input_ids``, ``attention_mask``, ``position_ids``,
``response_mask``) and

    rollout_log_probs       [N, R] float32  log-prob of each sampled token, 0 on padding
    response_lengths        [N]    int32
    prompt_lengths          [N]    int32
    rollout_weight_version  [N]    int64    weight version that sampled the row
    meta finish_reason      "stop" (EOS or a stop id, kept as the last token) | "length"
    meta response_text      when SamplingSpec.detokenize
    info temperature, n, weight_version, sampling_vocab_size, log_prob_mode, dropped

``rollout_log_probs`` are vLLM's *processed* log-probs; see
``polyrl.rollout.sampling`` for the exact convention and the vocabulary mask the
trainer must apply (``info["sampling_vocab_size"]``).

Recovery: servers are Ray actors with ``max_restarts``. A shard whose server dies or
reports stale weights is retried once on the next server, after the failed server has
been waited for and re-synced from the retained object-store buckets of the last push.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from polyrl.batch import Batch, from_token_lists
from polyrl.cluster.groups import WorkerGroup
from polyrl.rollout.engine_start import START_TIMES
from polyrl.rollout.engines import LIMITS
from polyrl.rollout.sampling import OVERLONG_POLICIES, RolloutConfig, SamplingSpec
from polyrl.rollout.server import RolloutServer, StaleWeightsError, sampling_vocab, server_env
from polyrl.weight_sync import SyncStats, WeightSyncer

__all__ = ["RolloutPool", "PROMPT_KEY", "apply_overlong_policy"]

logger = logging.getLogger(__name__)

PROMPT_KEY = "prompt_ids"
LOG_PROB_MODE = "processed"  # log_softmax(mask(logits) / T), see polyrl.rollout.sampling


def apply_overlong_policy(
    prompts: Sequence[Sequence[int]],
    limit: int,
    policy: str,
) -> tuple[list[int], list[list[int]]]:
    """Indices kept and their (possibly left-truncated) prompts.

    Empty prompts are always an error (vLLM cannot start from nothing).
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong policy {policy!r} is not one of {list(OVERLONG_POLICIES)}")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(
            f"prompt_ids of sample(s) {empty[:8]} are empty; every prompt needs at least "
            f"one token (apply the chat template before generate)"
        )
    long = [(i, len(p)) for i, p in enumerate(prompts) if len(p) > limit]
    if long and policy == "error":
        (i, n), rest = long[0], [j for j, _ in long[1:]]
        more = f" (also samples {rest[:8]})" if rest else ""
        raise ValueError(
            f"prompt of sample {i} has {n} tokens, more than max_prompt_len={limit}{more}; "
            f"raise RolloutConfig.max_prompt_len / max_model_len or set "
            f"overlong_prompt='truncate_left' or 'drop'"
        )
    bad = {i for i, _ in long}
    kept = [i for i in range(len(prompts)) if not (policy == "drop" and i in bad)]
    return kept, [list(map(int, prompts[i]))[-limit:] for i in kept]


class RolloutPool:
    """``config.num_servers`` :class:`RolloutServer` actors; call after ``ray.init``.

    placement: server index -> Ray actor options (resources and scheduling strategy,
      e.g. ``polyrl.cluster.placement.Placement.options("rollout", i)``), replacing the
      resources derived from the config; how a server joins a colocated GPU pool.
    wait: wait for the servers to start (False: the caller calls :meth:`ready` later).
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        placement: Callable[[int], dict[str, Any]] | None = None,
        wait: bool = True,
    ):
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "RolloutPool needs a Ray session: call ray.init(...) first (on a small CPU "
                "host e.g. ray.init(num_cpus=2, include_dashboard=False))"
            )
        self.config = config
        self.placement = placement
        self.version = 0
        self._retained: list | None = None
        # Fresh buckets of the current weights, for re-syncing a restarted server when the
        # last push retained nothing (cuda_ipc, nccl); RLTrainer sets it to the actor's.
        self.resync_source: Callable[[], Iterable[Sequence[tuple[str, Any]]]] | None = None
        self._syncers: dict[tuple[str, bool], WeightSyncer] = {}  # update_weights' own
        # The asynchronous engine samples a batch without holding its actor (abort and
        # other episodes' turns get through meanwhile).
        self.generate_method = "generate_async" if config.asynchronous else "generate"
        self.group = self._start_servers()
        self._starting: Any = self.group.submit("info")
        self._planned_vocab: int | None = None
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until every server has started (within ``ready_timeout_s``) and read their
        start-up facts. ``RolloutPool(wait=False)`` leaves this to its caller, which starts
        the trainer's roles while vLLM starts (``polyrl.loop.trainer``)."""
        if self._starting is None:
            return
        self.infos = self.group.started(
            self._starting,
            fix="If resources are short, lower RolloutConfig.num_cpus/num_servers; otherwise "
            "raise RolloutConfig.ready_timeout_s",
        )
        self._starting = None
        first = self.infos[0]
        self.pad_token_id = int(first["pad_token_id"])
        self.eos_token_id = int(first["eos_token_id"])
        self.sampling_vocab_size = int(first["sampling_vocab_size"])
        if self._planned_vocab not in (None, self.sampling_vocab_size):
            raise RuntimeError(
                f"the rollout servers sample from {self.sampling_vocab_size} token ids "
                f"(tokenizer {first['tokenizer_size']}, model {first['model_vocab_size']}), "
                f"the trainer's roles were built for {self._planned_vocab}: the servers' "
                f"model or tokenizer is not RolloutConfig.model_path's "
                f"({self.config.model_path})"
            )

    def planned_sampling_vocab(self, tokenizer_size: int) -> int:
        """The servers' ``sampling_vocab_size`` before they have started, from the model's
        config.json and the tokenizer's size (the trainer builds its roles with it while
        vLLM starts); :meth:`ready` checks the servers agree."""
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(self.config.model_path)
        model_vocab = int(hf.get_text_config().vocab_size)
        self._planned_vocab = sampling_vocab(tokenizer_size, model_vocab, self.config)
        return self._planned_vocab

    @property
    def limits(self) -> dict[str, int]:
        """The scheduler limits the servers' engines run at, as they read them back
        (``max_num_seqs``, ``max_num_batched_tokens``; ``RolloutConfig``)."""
        return {k: int(self.infos[0][k]) for k in LIMITS}

    @property
    def start_times(self) -> dict[str, float] | None:
        """Where the servers' starts went, each of ``engine_start.START_TIMES`` the largest
        of any server (they start side by side); None where this pool started none (a warm
        session's servers, attached to)."""
        if self.group.session == "attach":
            return None
        starts = [info.get("start_times") or {} for info in self.infos]
        return {k: max(s.get(k, 0.0) for s in starts) for k in START_TIMES}

    @property
    def servers(self) -> list[Any]:
        """The servers' Ray actor handles, in index order."""
        return self.group.workers

    # -------------------------------------------------------------- start-up
    def _resources(self) -> dict[str, float]:
        import ray

        c = self.config
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
        num_cpus = c.num_cpus if c.num_cpus is not None else (1.0 if has_gpu else 0.5)
        num_gpus = (
            c.num_gpus
            if c.num_gpus is not None
            else (float(c.tensor_parallel_size) if has_gpu else 0.0)
        )
        return {"num_cpus": num_cpus, "num_gpus": num_gpus}

    def _start_servers(self) -> WorkerGroup:
        import ray

        c = self.config
        res = self._resources()
        total = ray.cluster_resources()
        for key, ray_key in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            need = res[key] * c.num_servers
            if need > total.get(ray_key, 0) + 1e-9:
                raise RuntimeError(
                    f"RolloutPool: {c.num_servers} servers x {key}={res[key]} need {need} {ray_key}, "
                    f"the Ray cluster has {total.get(ray_key, 0)}; lower RolloutConfig.num_servers "
                    f"or RolloutConfig.{key}, or start Ray with more {ray_key}s"
                )
        return WorkerGroup(
            "rollout",
            RolloutServer,
            (c,),
            num_workers=c.num_servers,
            options=self.placement or (lambda i: res),
            env=server_env(c),
            max_restarts=c.max_restarts,
            timeout_s=c.request_timeout_s,
            ready_timeout_s=c.ready_timeout_s,
        )

    # -------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Batch,
        spec: SamplingSpec,
        *,
        overlong: str | None = None,
        prompt_len: int | None = None,
        response_len: int | None = None,
    ) -> Batch:
        """Sample ``spec.n`` responses per row of ``prompts`` (see the module docstring).

        overlong: override ``RolloutConfig.overlong_prompt`` for this call.
        prompt_len / response_len: fixed padded widths (default: the longest), e.g.
          ``response_len=spec.max_tokens`` for a jitted trainer.
        """
        base, requests, dropped = self._requests(prompts, spec, overlong)
        results = self._dispatch(self.generate_method, requests, spec)
        return self.assemble(base.repeat(spec.n), results, spec, dropped, prompt_len, response_len)

    def placeholder(self, prompts: Batch, spec: SamplingSpec, response_len: int) -> Batch:
        """The batch :meth:`generate` would return, sampling nothing: a real rollout's
        columns, shapes and padding before the servers are up (the trainer's warm-up).
        Responses are ``spec.max_tokens`` tokens of id 0 (log-probs 0, version -1), but
        unless ``spec.ignore_eos`` each prompt's first is one token long (a sample that
        stopped early, as some do: every shard and mini-batch of the batch then has
        padding after responses too)."""
        base, requests, dropped = self._requests(prompts, spec, None)
        lengths = [spec.max_tokens] * len(requests)
        if not spec.ignore_eos:
            lengths[:: spec.n] = [1] * len(lengths[:: spec.n])
        results = [
            {
                "token_ids": [0] * n,
                "log_probs": [0.0] * n,
                "version": -1,
                "text": "",
                "finish_reason": "length" if n == spec.max_tokens else "stop",
            }
            for n in lengths
        ]
        # (the pad id and the servers' facts are not known yet: nothing reads them here)
        return rollout_columns(base.repeat(spec.n), results, spec, 0, None, response_len)

    def _requests(
        self, prompts: Batch, spec: SamplingSpec, overlong: str | None
    ) -> tuple[Batch, list[tuple[int, list[int]]], list[int]]:
        """The prompts kept (``RolloutConfig.overlong_prompt``, or ``overlong``), one
        ``(sample index, prompt ids)`` request per sample, and the rows dropped."""
        prompts.require(PROMPT_KEY, who="RolloutPool.generate")
        kept, ids = apply_overlong_policy(
            prompts[PROMPT_KEY], self.config.prompt_limit, overlong or self.config.overlong_prompt
        )
        dropped = sorted(set(range(len(prompts))) - set(kept))
        if not kept:
            shortest = min(len(p) for p in prompts[PROMPT_KEY])
            raise ValueError(
                f"RolloutPool.generate: every prompt of the batch ({len(dropped)}) is over "
                f"RolloutConfig.max_prompt_len={self.config.prompt_limit} tokens and was dropped "
                f"(the shortest has {shortest}); raise RolloutConfig.max_prompt_len (below "
                f"max_model_len={self.config.max_model_len}) or shorten the prompts"
            )
        base = prompts.take(kept).with_columns(meta={PROMPT_KEY: ids})
        n = spec.n
        # Seeds follow the prompt's index in the caller's batch, so dropping one prompt
        # does not change any other prompt's samples.
        requests = [(orig * n + j, p) for orig, p in zip(kept, ids) for j in range(n)]
        return base, requests, dropped

    def assemble(
        self,
        rep: Batch,
        results: list[dict[str, Any]],
        spec: SamplingSpec,
        dropped: list[int],
        prompt_len: int | None,
        response_len: int | None,
    ) -> Batch:
        batch = rollout_columns(rep, results, spec, self.pad_token_id, prompt_len, response_len)
        return batch.with_columns(**self.sample_info(spec, dropped))

    def sample_info(self, spec: SamplingSpec, dropped: list[int]) -> dict[str, Any]:
        """The ``info`` of a batch these servers sampled with ``spec``."""
        return dict(
            temperature=spec.temperature,
            n=spec.n,
            weight_version=self.version,
            sampling_vocab_size=self.sampling_vocab_size,
            log_prob_mode=LOG_PROB_MODE,
            dropped=dropped,
        )

    def generate_ids(self, requests: list[tuple], spec: SamplingSpec) -> list[dict[str, Any]]:
        """One sample per ``(sample_index, prompt_ids[, max_tokens])`` request, spread over
        the servers (with :meth:`generate`'s recovery): ``RolloutServer.generate``'s
        results in order. The OpenAI endpoint's calls (``polyrl.rollout.openai_endpoint``)."""
        return self._dispatch(self.generate_method, requests, spec)

    async def generate_on(
        self, server: int, requests: list[tuple], spec: SamplingSpec
    ) -> list[dict[str, Any]]:
        """:meth:`generate_ids` on server ``server`` as a coroutine (one episode's turn:
        ``polyrl.rollout.episodes``; an episode keeps its server, whose prefix cache
        holds its earlier turns), with the same recovery."""
        import asyncio

        method = self.generate_method
        call = getattr(self.servers[server], method).remote(
            requests, spec, expected_version=self.version
        )
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(call.future()), self.config.request_timeout_s
            )
        except Exception as e:  # classified by _is_recoverable; others re-raised
            if not _is_recoverable(e):
                raise
            return await asyncio.to_thread(
                self._retry, method, requests, (spec,), failed=server, error=e
            )

    # -------------------------------------------------------------- dispatch
    def generate_lossy(
        self, calls: list[tuple[list[tuple], SamplingSpec]]
    ) -> tuple[list[list[dict[str, Any] | None]], list[int]]:
        """Several :meth:`generate_ids` calls (``(requests, spec)`` each) submitted at once
        and split over the servers as it splits one. A server that fails loses its share:
        those results are None (not retried) and the server is brought back to the pool's
        weight version before this returns. Returns the results per call and the servers
        that failed (``polyrl.loop.streaming``: only the episodes in flight there are lost)."""
        failed: set[int] = set()

        def lose(rank: int, index: list[int], error: BaseException) -> list[None]:
            if not _is_recoverable(error):
                raise error
            if rank not in failed:
                logger.warning(
                    "rollout server %d failed (%s: %s); its requests in flight are lost",
                    rank,
                    type(error).__name__,
                    error,
                )
            failed.add(rank)
            return [None] * len(index)

        submitted = [
            self.group.submit(self.generate_method, requests, spec, expected_version=self.version)
            for requests, spec in calls
        ]
        outs = [c.result(on_error=lose) for c in submitted]
        for i in sorted(failed):
            self._recover(i)
        return outs, sorted(failed)

    def _dispatch(self, method: str, items: list[Any], *args: Any) -> list[Any]:
        """Split ``items`` into contiguous shards, one per server, keep order; a failed
        shard is retried once on the next server after the failed one is re-synced."""

        def retry(failed: int, index: list[int], error: BaseException) -> list[Any]:
            if not _is_recoverable(error):
                raise error
            return self._retry(method, [items[j] for j in index], args, failed, error)

        return self.group.call(method, items, *args, expected_version=self.version, on_error=retry)

    def _retry(
        self, method: str, shard: list[Any], args: tuple, failed: int, error: BaseException
    ) -> list[Any]:
        logger.warning(
            "rollout server %d failed (%s: %s); re-syncing it and retrying its %d requests once",
            failed,
            type(error).__name__,
            error,
            len(shard),
        )
        self._recover(failed)
        target = (failed + 1) % len(self.servers)
        if target != failed:
            self._recover(target)  # cheap when healthy: one info() call
        try:
            return self.group.call_one(target, method, shard, *args, expected_version=self.version)
        except Exception as e:
            raise RuntimeError(
                f"RolloutPool.{method}: {len(shard)} requests failed on server {failed} "
                f"({type(error).__name__}) and again on server {target}: {e}"
            ) from e

    def _recover(self, i: int) -> None:
        """Wait until server ``i`` answers (Ray restarts it) and bring it to ``self.version``."""
        info = self.group.revive(i, "info", fix="RolloutConfig.max_restarts / ready_timeout_s")
        if info["version"] != self.version:
            logger.warning(
                "rollout server %d is at weight version %d (boot %s), pool at %d: re-syncing",
                i,
                info["version"],
                info["boot_id"][:8],
                self.version,
            )
            self._resync([self.servers[i]])

    def _resync(self, servers: list[Any]) -> None:
        syncer = WeightSyncer(
            servers, "object_store", retain=False, timeout_s=self.config.request_timeout_s
        )
        if self._retained is not None:
            syncer.replay(self._retained, self.version)
        elif self.resync_source is not None:
            syncer.push(self.resync_source(), self.version)
        else:
            raise RuntimeError(
                f"a rollout server came back at a weight version other than {self.version} and "
                f"the pool has nothing to re-sync it from: push with transport='object_store' "
                f"(retain=True) or set RolloutPool.resync_source"
            )

    # --------------------------------------------------------------- weights
    def weight_syncer(
        self, transport: str = "object_store", *, retain: bool = True
    ) -> WeightSyncer:
        """A syncer for these servers, to run where the exported tensors live; report
        its result back with :meth:`commit`."""
        return WeightSyncer(
            self.servers,
            transport,
            retain=retain,
            timeout_s=self.config.request_timeout_s,
            devices=[info["device_uuid"] for info in self.infos],
        )

    def update_weights(
        self,
        buckets: Iterable[Sequence[tuple[str, Any]]],
        transport: str = "object_store",
        *,
        retain: bool = True,
    ) -> SyncStats:
        """Push ``buckets`` (an engine's ``export_weights``) from this process to every
        server as version ``self.version + 1`` ("nccl": this process is rank 0 of the
        broadcast group, formed on first use and after a server restart). A server dying
        mid-push (object store) is left out of it and re-synced by :meth:`commit` once Ray
        has restarted it."""
        key = (transport, retain)
        if key not in self._syncers:
            self._syncers[key] = self.weight_syncer(transport, retain=retain)
        syncer = self._syncers[key]
        syncer.ensure_group()
        stats = syncer.push(buckets, self.version + 1)
        self.commit(stats)
        return stats

    @property
    def retained(self) -> list | None:
        """The last push's object-store buckets, [(payload ref, metas)] (None: it kept
        none: cuda_ipc, nccl, a snapshot push); they hold weight version ``version``."""
        return self._retained

    def commit(self, stats: SyncStats) -> None:
        """Record a finished push (its version, and its retained buckets for re-syncs);
        servers that died during it are re-synced now, before they generate again."""
        self.version = stats.version
        self._retained = stats.retained
        for i in stats.lost:
            logger.warning("rollout server %d died during weight push %d", i, stats.version)
            self._recover(i)

    def weight_versions(self) -> list[int]:
        return self.group.call("weight_version")

    # ------------------------------------------------------------ colocation
    def sleep(self, level: int = 1) -> list[bool]:
        """Free the servers' GPU memory for colocated training (no-op on CPU)."""
        return self.group.call("sleep", level)

    def wake_up(self) -> list[bool]:
        return self.group.call("wake_up")

    def abort(self) -> int:
        """Stop every request in flight on every server (``RolloutServer.abort``: each
        returns with ``finish_reason="abort"``); how many there were."""
        return sum(self.group.call("abort"))

    def shutdown(self) -> None:
        import ray

        # Each engine stops its engine-core process first (the GPU memory is that
        # process's); a server that does not answer in time is killed with it. A warm
        # session's servers, borrowed by an attached run, keep running.
        if self.group.session != "attach":
            ray.wait(
                [s.shutdown.remote() for s in self.servers],
                num_returns=len(self.servers),
                timeout=30,
            )
        self.group.shutdown()


def rollout_columns(
    rep: Batch,
    results: list[dict[str, Any]],
    spec: SamplingSpec,
    pad_token_id: int,
    prompt_len: int | None,
    response_len: int | None,
) -> Batch:
    """``rep`` (one row per sample) with the samples' sequence layout (``polyrl.batch``)
    and their per-sample columns: the rollout's log-probs, lengths, weight versions,
    finish reasons (and texts)."""
    responses = [r["token_ids"] for r in results]
    seq = from_token_lists(
        list(rep[PROMPT_KEY]),
        responses,
        pad_token_id,
        prompt_len=prompt_len,
        response_len=response_len,
    )
    log_probs = np.zeros(seq["responses"].shape, dtype=np.float32)
    for row, r in enumerate(results):
        log_probs[row, : len(r["log_probs"])] = r["log_probs"]
    tensors = {
        **seq.tensors,
        "rollout_log_probs": log_probs,
        "response_lengths": np.array([len(r) for r in responses], dtype=np.int32),
        "prompt_lengths": np.array([len(p) for p in rep[PROMPT_KEY]], dtype=np.int32),
        "rollout_weight_version": np.array([r["version"] for r in results], dtype=np.int64),
    }
    meta: dict[str, Any] = {"finish_reason": [r["finish_reason"] for r in results]}
    if spec.detokenize:
        meta["response_text"] = [r["text"] for r in results]
    return rep.with_columns(tensors, meta)


def _is_recoverable(error: Exception) -> bool:
    """A dead/restarting server or stale weights (not a bug in the request)."""
    import ray

    return isinstance(
        error,
        (StaleWeightsError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError),
    )
