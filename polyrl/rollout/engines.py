"""The vLLM engine inside a rollout server: asynchronous (default) or synchronous.

Both classes give :class:`~polyrl.rollout.server.RolloutServer` the same blocking calls
(``generate`` of a whole batch, ``rpc`` to the workers, ``reset_prefix_cache``,
``sleep``, ``wake_up``, ``abort``, ``shutdown``); only :class:`AsyncEngine` also serves
many callers at once (``submit``), which is what lets every episode run its own turns
(docs/rollout.md "Engines").

* :class:`AsyncEngine` (``RolloutConfig.engine="async"``): vLLM's ``AsyncLLM`` on an
  event loop of its own, in a thread of the server's process; its engine core is always a
  process of its own (vLLM starts it). Each request is one ``generate`` coroutine with
  ``RequestOutputKind.FINAL_ONLY`` (one output object per request, none per token); a
  batch is all of them gathered at once, so the engine schedules them as ``LLM.generate``
  would. A request that a caller gives up on, or that :meth:`AsyncEngine.abort` stops,
  ends with ``finish_reason="abort"`` and the tokens sampled so far. With
  ``track_versions`` (``RolloutConfig.continue_in_place``) a request streams its
  cumulative output instead, so that the engine knows how many tokens each request in
  flight holds when :meth:`AsyncEngine.resume` brings a new weight version: the final
  output then carries ``polyrl_token_versions``, the version of each sampled token.
* :class:`SyncEngine` (``engine="sync"``, bound by hand: single-turn runs only):
  ``vllm.LLM``, one batch at a time, the engine core in the server's process unless
  ``RolloutConfig.in_process_engine=False``.

Token ids in (``{"prompt_token_ids": [...]}``), token ids and flat log-probs out: neither
engine tokenizes or detokenizes (``SamplingSpec.vllm_kwargs``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

__all__ = ["AsyncEngine", "SyncEngine", "make_engine", "scheduler_limits"]

LIMITS = ("max_num_seqs", "max_num_batched_tokens")


def scheduler_limits(vllm_config: Any) -> dict[str, int]:
    """The limits an engine's scheduler runs at, read back from its ``VllmConfig``:
    ``max_num_seqs`` (requests sampled together) and ``max_num_batched_tokens`` (tokens
    one engine step takes)."""
    scheduler = vllm_config.scheduler_config
    return {name: int(getattr(scheduler, name)) for name in LIMITS}


class SyncEngine:
    """``vllm.LLM`` behind the engine interface (module docstring)."""

    concurrent = False

    def __init__(self, kwargs: dict[str, Any]):
        from vllm import LLM

        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.vllm_config = self.llm.llm_engine.vllm_config
        self.model_config = self.vllm_config.model_config

    def generate(self, prompts: Sequence[dict], params: Sequence[Any]) -> list[Any]:
        """One final ``RequestOutput`` per prompt, in order."""
        return self.llm.generate(prompts, params, use_tqdm=False)

    def rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def abort(self) -> int:
        return 0  # a batch runs to its end inside one call: nothing is left in flight

    def shutdown(self) -> None:
        pass


class AsyncEngine:
    """vLLM's ``AsyncLLM`` on its own event-loop thread (module docstring).

    Blocking calls (``generate``, ``rpc``, ...) run a coroutine on that loop and wait;
    :meth:`submit` returns a future instead, for callers on another event loop (the
    server's ``generate_async``). ``inflight`` counts the requests being sampled.
    """

    concurrent = True

    def __init__(self, kwargs: dict[str, Any], track_versions: bool = False):
        self.track_versions = track_versions
        self.version = 0  # the weights' version, set by resume
        # per request in flight, with track_versions: tokens received so far, and the
        # (tokens received, version) at which each version took over
        self.received: dict[str, int] = {}
        self.switches: dict[str, list[tuple[int, int]]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="polyrl-vllm-async", daemon=True
        )
        self.thread.start()
        self.ids = itertools.count()
        self.inflight: dict[str, int] = {}  # request id -> 1, while it is sampled
        self.idle = asyncio.Event()  # set while nothing is in flight (loop's own)
        try:
            self.engine = self.call(self._start(kwargs))
        except BaseException:
            self._stop_loop()
            raise
        tokenizer = self.engine.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # an async getter in some vLLM releases
            tokenizer = self.call(tokenizer)
        self.tokenizer = tokenizer
        self.vllm_config = self.engine.vllm_config
        self.model_config = self.vllm_config.model_config

    async def _start(self, kwargs: dict[str, Any]) -> Any:
        # Created on its loop: the output handler task starts with it, on that loop.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        _quiet_raw_prompt_warning()
        self.idle.set()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def call(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the engine's loop and wait for its result."""
        return self.submit(coro).result()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def one(self, prompt: dict, params: Any) -> Any:
        """One request's final ``RequestOutput``."""
        from vllm.sampling_params import RequestOutputKind

        track = self.track_versions
        params.output_kind = RequestOutputKind.CUMULATIVE if track else RequestOutputKind.FINAL_ONLY
        rid = f"polyrl-{next(self.ids)}"
        self.inflight[rid] = 1
        self.idle.clear()
        if track:
            self.received[rid], self.switches[rid] = 0, [(0, self.version)]
        try:
            final = None
            async for out in self.engine.generate(prompt, params, rid):
                final = out
                if track:
                    self.received[rid] = len(out.outputs[0].token_ids)
            if track and final is not None:
                final.polyrl_token_versions = _token_versions(
                    len(final.outputs[0].token_ids), self.switches[rid]
                )
            return final
        finally:
            del self.inflight[rid]
            self.received.pop(rid, None)
            self.switches.pop(rid, None)
            if not self.inflight:
                self.idle.set()

    async def agenerate(self, prompts: Sequence[dict], params: Sequence[Any]) -> list[Any]:
        """Every request at once (each its own coroutine), outputs in order."""
        return list(await asyncio.gather(*(self.one(p, s) for p, s in zip(prompts, params))))

    def generate(self, prompts: Sequence[dict], params: Sequence[Any]) -> list[Any]:
        return self.call(self.agenerate(prompts, params))

    def rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.call(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self.call(self.engine.reset_prefix_cache()))

    def sleep(self, level: int) -> None:
        self.call(self.engine.sleep(level))

    def wake_up(self) -> None:
        self.call(self.engine.wake_up())

    def drain(self, timeout_s: float) -> None:
        """Wait until no request is in flight (a weight update must not change the
        weights under one), at most ``timeout_s``."""

        async def wait() -> None:
            await asyncio.wait_for(self.idle.wait(), timeout_s)

        self.call(wait())

    def pause(self) -> None:
        """Hold every request in flight where it is (its KV cache kept) and start none
        until :meth:`resume`: the weights can change under them."""
        self.call(self.engine.pause_generation(mode="keep", clear_cache=False))

    def resume(self, version: int) -> None:
        """Go on after :meth:`pause` with weight ``version``: the tokens each request in
        flight samples from now on are that version's."""

        async def go() -> None:
            # pause_generation returned after the engine core's last outputs were handed
            # to the requests' queues; let every request take its own before counting
            for _ in range(3):
                await asyncio.sleep(0)
            for rid, switches in self.switches.items():
                switches.append((self.received[rid], version))
            self.version = version
            await self.engine.resume_generation()

        self.call(go())

    def tokens_in_flight(self) -> list[int]:
        """With ``track_versions``: the tokens each request in flight has sampled so far."""

        async def read() -> list[int]:
            return list(self.received.values())

        return self.call(read())

    def abort(self) -> int:
        """Stop every request in flight: each ends with ``finish_reason="abort"`` and
        the tokens sampled so far. Returns how many there were."""
        ids = list(self.inflight)
        if ids:
            self.call(self.engine.abort(ids))
        return len(ids)

    def shutdown(self) -> None:
        try:
            # AsyncLLM.shutdown stops the engine core before it cancels its output handler,
            # which then logs the core's death as an EngineDeadError traceback at the end
            # of every run: cancel the handler first, on its own loop.
            handler = getattr(self.engine, "output_handler", None)
            if handler is not None:
                self.call(_cancelled(handler))
            self.engine.shutdown()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _token_versions(length: int, switches: list[tuple[int, int]]) -> Any:
    """The version of each of ``length`` tokens: ``switches`` lists (tokens received,
    version) from the request's start, each version owning the tokens from its count on."""
    import numpy as np

    versions = np.empty(length, dtype=np.int32)
    for start, version in switches:
        versions[start:] = version
    return versions


def make_engine(
    asynchronous: bool, kwargs: dict[str, Any], track_versions: bool = False
) -> AsyncEngine | SyncEngine:
    """The engine of ``RolloutConfig.engine`` (``RolloutConfig.asynchronous``); the
    asynchronous one with ``track_versions`` for ``RolloutConfig.continue_in_place``."""
    return AsyncEngine(kwargs, track_versions) if asynchronous else SyncEngine(kwargs)


class _RawPromptWarning(logging.Filter):
    """vLLM (0.32) warns once per server that ``AsyncLLM.generate`` with a prompt dict
    is deprecated in favour of its renderer's output. polyrl's prompts are token ids,
    which the renderer only wraps; the warning says nothing to act on, and it would be
    the one line a quiet run prints from the servers."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passing raw prompts to InputProcessor")


def _quiet_raw_prompt_warning() -> None:
    log = logging.getLogger("vllm.v1.engine.input_processor")
    if not any(isinstance(f, _RawPromptWarning) for f in log.filters):
        log.addFilter(_RawPromptWarning())
