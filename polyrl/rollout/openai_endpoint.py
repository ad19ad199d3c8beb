"""An OpenAI-compatible chat-completions endpoint on a rollout pool, recording exact tokens.

:class:`AgentEndpoint` serves ``POST /v1/chat/completions`` and ``GET /v1/models`` on
127.0.0.1 (a free port; Starlette on uvicorn, in a thread of its own) for agent code written
against the ``openai`` client (docs/agents.md "Agents written against the OpenAI
client"). A call is recorded under the episode named by its base URL,
``http://127.0.0.1:<port>/episodes/<id>/v1`` (``/v1`` alone: each call on its own, in
``calls()``):

- the messages go through the chat template with the request's ``tools`` (the tokenizer's
  ``apply_chat_template``) and are sampled by the rollout servers. On the asynchronous
  engine (the default) each call is its own request on its episode's server
  (``RolloutPool.generate_on``, the episode loop's path: the server's prefix cache holds
  the episode's earlier calls), so an agent's call never waits for another agent's; on
  the synchronous engine the calls that arrive together go to the servers in one batch
  (``RolloutPool.generate_ids``);
- the turn's text is parsed with ``polyrl.envs.parsers`` (``tool_parser``, "hermes") into
  OpenAI ``tool_calls`` when the request offered tools;
- the episode keeps exact token ids as :class:`~polyrl.rollout.episodes.EpisodeRunner`
  does: when a call's messages are the previous call's messages, the reply it got and new
  messages (tool results, a user turn), its prompt is the previous prompt + the sampled
  ids + the template's tokens for the new messages (``ChatTokens.observation``), never a
  re-tokenization. A call whose messages do not extend the previous ones, or that offers
  other tools (the agent rewrote its history), starts the episode's trajectory afresh:
  only the calls from the last rewrite on are trained, ``info["history_rewrites"]``
  counts them and ``info["rewrite/..."]`` says what differed (:func:`rewrite_reasons`).

:func:`run_agents` plays registered agents (``polyrl.envs.agents``) on episodes of the
episode loop, each with an ``openai.AsyncOpenAI`` client on its own base URL, and leaves
each :class:`~polyrl.rollout.episodes.Episode` as the loop would (sampled and observation
segments, the reward on the last sampled token, the finish reason); an agent that raises
or runs past ``EpisodeConfig.agent_timeout_s`` ends its episode only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import numbers
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polyrl.envs.base import EpisodeConfig
from polyrl.rollout.sampling import SamplingSpec
from polyrl.rollout.trajectory import ChatTokens, Episode, TemplateError

__all__ = ["AgentEndpoint", "RequestError", "rewrite_reasons", "run_agents"]

logger = logging.getLogger(__name__)

# Request fields that change nothing here (accepted so that agent code runs unchanged).
IGNORED = {"model", "user", "stream_options", "metadata", "store", "parallel_tool_calls"}
SAMPLING = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop"}
KNOWN = IGNORED | SAMPLING | {"messages", "tools", "tool_choice", "n", "logprobs", "stream"}
KNOWN |= {"top_logprobs"}
DEFAULT = "default"  # the episode of calls to plain /v1


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400, OpenAI's error shape, ``param``: the
    field). ``finish`` names the episode limit it hit, if any."""

    def __init__(self, message: str, param: str | None = None, finish: str | None = None):
        super().__init__(message)
        self.param, self.finish = param, finish


def _text(content: Any) -> str:
    """A message's content as text (None -> "", content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    raise RequestError(f"message content {content!r:.80} is not a string", "messages")


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def rewrite_reasons(
    history: Sequence[tuple], messages: Sequence[tuple], tools_before: Any, tools: Any
) -> list[str]:
    """What made a call rewrite its episode's history (``_normal`` messages: the previous
    call's with its reply, and this call's), as ``episode/rewrite/...`` metric names:
    ``message/<index>/<role>`` for the first of this call's messages that differs from
    the history (or the first history message it leaves out), ``tool_added/<name>`` and
    ``tool_removed/<name>`` for the tools offered now and not before, or before and not
    now (the template renders the tools into the prompt: other tools, other tokens)."""
    out = []
    index = next(
        (i for i, (a, b) in enumerate(zip(history, messages)) if a != b),
        len(messages) if len(messages) < len(history) else None,
    )
    if index is not None:
        role = (messages[index] if index < len(messages) else history[index])[0]
        out.append(f"message/{index}/{role}")
    before, now = _tool_names(tools_before), _tool_names(tools)
    out += [f"tool_added/{name}" for name in sorted(now - before)]
    out += [f"tool_removed/{name}" for name in sorted(before - now)]
    if not out and tools != tools_before:  # the same names, other definitions
        out.append("tools_changed")
    return out


def _tool_names(tools: Any) -> set[str]:
    return {str((t.get("function") or t).get("name")) for t in tools or ()}


def _normal(message: Mapping[str, Any]) -> tuple:
    """What makes two messages the same for the extension check (the client may echo a
    reply back as a dict or as the client's model, with or without None fields)."""
    calls = tuple(
        (
            c["function"]["name"],
            json.dumps(_arguments(c["function"].get("arguments")), sort_keys=True),
        )
        for c in message.get("tool_calls") or ()
    )
    return (
        message.get("role"),
        _text(message.get("content")),
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    )


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A client message as the chat template takes it: text content, tool calls with
    their arguments as objects (Qwen-style templates render them)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise RequestError(f"each message needs a 'role', got {message!r:.80}", "messages")
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments")),
                },
            }
            for c in message["tool_calls"]
        ]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


@dataclasses.dataclass
class EpisodeCalls:
    """One episode's recorded calls and the state its next call extends."""

    episode: Episode
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    history: list[tuple] | None = None  # the last call's messages + its reply, normalised
    view: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as the template saw
    tools: Any = None
    raw: dict[tuple, str] = dataclasses.field(default_factory=dict)  # reply -> sampled text
    last_sampled: list[int] = dataclasses.field(default_factory=list)
    # calls of one episode made at once (asyncio.gather) run one after the other
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class AgentEndpoint:
    """The endpoint (module docstring). ``spec``: the run's sampling (None: each request's
    ``temperature``, ``top_p``, ``seed``; with a spec those request fields are ignored,
    since the trainer's log-probs assume the run's); ``config``: the episode limits
    (``max_turns`` calls, ``max_episode_tokens``, ``max_tool_calls``)."""

    def __init__(
        self,
        pool: Any,
        tokenizer: Any,
        config: EpisodeConfig | None = None,
        spec: SamplingSpec | None = None,
        tool_parser: str = "hermes",
        model_name: str = "polyrl",
    ):
        self.pool, self.tokenizer, self.spec = pool, tokenizer, spec
        self.config = config or EpisodeConfig()
        self.chat = ChatTokens(tokenizer)
        self.tool_parser, self.model_name = tool_parser, model_name
        self.episodes: dict[str, EpisodeCalls] = {DEFAULT: EpisodeCalls(Episode(0, 0, {}))}
        self.pending: list[tuple[tuple, SamplingSpec, asyncio.Future]] = []
        self.draining = False
        self.warned_sampling = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = self._server()
        self.serving = asyncio.run_coroutine_threadsafe(
            self.server.serve(sockets=[self.sock]), self.loop
        )
        deadline = time.monotonic() + 30
        while not self.server.started:
            if self.serving.done() or time.monotonic() > deadline:
                self.serving.result(timeout=0)  # raises what stopped it
                raise RuntimeError("the OpenAI endpoint did not start within 30 s")
            time.sleep(0.01)

    # ------------------------------------------------------------- serving
    def base_url(self, episode: str | None = None) -> str:
        """The ``base_url`` of an ``openai`` client whose calls record under ``episode``."""
        root = f"http://127.0.0.1:{self.port}"
        return f"{root}/v1" if episode is None else f"{root}/episodes/{episode}/v1"

    def _server(self) -> Any:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def error(e: RequestError) -> JSONResponse:
            body = {"message": str(e), "type": "invalid_request_error", "param": e.param}
            return JSONResponse({"error": body | {"code": e.finish}}, status_code=400)

        async def completions(request: Any) -> JSONResponse:
            try:
                body = await request.json()
                episode = request.path_params.get("episode", DEFAULT)
                return JSONResponse(await self.complete(episode, body))
            except RequestError as e:
                return error(e)
            except json.JSONDecodeError as e:
                return error(RequestError(f"the body is not JSON: {e}"))

        async def models(request: Any) -> JSONResponse:
            card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "polyrl"}
            return JSONResponse({"object": "list", "data": [card]})

        app = Starlette(
            routes=[
                Route(f"{root}/chat/completions", completions, methods=["POST"])
                for root in ("/v1", "/episodes/{episode}/v1")
            ]
            + [Route(f"{root}/models", models) for root in ("/v1", "/episodes/{episode}/v1")]
        )
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        return uvicorn.Server(config)

    def close(self) -> None:
        self.server.should_exit = True
        try:
            self.serving.result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.sock.close()

    # ------------------------------------------------------------ requests
    def _spec(self, body: Mapping[str, Any]) -> tuple[SamplingSpec, int | None]:
        """The request's sampling (the run's with a spec) and its max_tokens, if given."""
        unknown = sorted(set(body) - KNOWN)
        if unknown:
            raise RequestError(f"unsupported request fields {unknown}", unknown[0])
        if body.get("n", 1) != 1:
            raise RequestError(f"n={body['n']}: one choice per call (call again)", "n")
        if body.get("stream"):
            raise RequestError("stream=true is not supported", "stream")
        if body.get("top_logprobs"):
            raise RequestError("top_logprobs: only the sampled token's log-prob", "top_logprobs")
        stop = body.get("stop") or []
        stop_ids = []
        for s in [stop] if isinstance(stop, str) else stop:
            ids = self.chat.encode(s)
            if len(ids) != 1:
                raise RequestError(
                    f"stop={s!r} is {len(ids)} tokens; only single-token stops are supported "
                    f"(the turn's ids must stay exactly what was sampled)",
                    "stop",
                )
            stop_ids += ids
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if self.spec is not None:
            asked = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
            if any(asked[k] != getattr(self.spec, k) for k in asked) and not self.warned_sampling:
                self.warned_sampling = True
                logger.warning(
                    "an agent asked for %s; the run samples with temperature=%g top_p=%g (the "
                    "trainer's log-probs assume them), so those request fields are ignored",
                    asked,
                    self.spec.temperature,
                    self.spec.top_p,
                )
            spec = self.spec
        else:
            temperature = body.get("temperature")
            spec = SamplingSpec(
                temperature=1.0 if temperature is None else float(temperature),
                top_p=float(body.get("top_p") or 1.0),
                seed=body.get("seed"),
                max_tokens=int(limit or self.config.max_episode_tokens),
            )
        if stop_ids:
            spec = dataclasses.replace(spec, stop_token_ids=(*spec.stop_token_ids, *stop_ids))
        return spec, None if limit is None else int(limit)

    def _state(self, key: str) -> EpisodeCalls:
        if key == DEFAULT:  # plain /v1: each call on its own (recorded in order: calls())
            return EpisodeCalls(Episode(0, 0, {}))
        if key not in self.episodes:
            self.episodes[key] = EpisodeCalls(Episode(len(self.episodes), -1, {}))
        return self.episodes[key]

    def _prompt(self, s: EpisodeCalls, messages: list, tools: Any) -> list[int]:
        """The call's prompt ids: the episode's ids extended by the new messages, or a
        fresh rendering when the messages do not extend the last call's (a rewrite)."""
        e = s.episode
        normal = [_normal(m) for m in messages]
        view = [
            {"role": "assistant", "content": s.raw[n]} if n in s.raw else _template_message(m)
            for m, n in zip(messages, normal)
        ]
        if s.history is not None and normal[: len(s.history)] == s.history and tools == s.tools:
            new = view[len(s.history) :]
            try:
                obs, rendered = self.chat.observation(
                    s.view, new, tools, s.last_sampled, e.rendered
                )
            except TemplateError as err:
                e.end("template_error", str(err))
                raise RequestError(f"the chat template cannot extend the episode: {err}") from None
            if e.length + len(obs) >= self.config.max_episode_tokens:
                e.end("max_tokens", f"an observation of {len(obs)} tokens does not fit")
                raise RequestError(
                    "the episode's token budget is used up", "messages", "max_tokens"
                )
            e.append("observation", len(e.turns) - 1, obs, np.zeros(len(obs)), -1)
            e.turns[-1]["observation"] = [dict(m) for m in new]
            e.turns[-1]["observation_tokens"] = len(obs)
            s.view, e.rendered = view, rendered
            return e.prompt_ids + e.ids
        if s.history is not None:  # the agent rewrote its history: a new trajectory
            e.info["history_rewrites"] = e.info.get("history_rewrites", 0.0) + 1
            for what in rewrite_reasons(s.history, normal, s.tools, tools):
                e.info[f"rewrite/{what}"] = 1.0
            e.prompt_ids, e.ids, e.sampled, e.log_probs, e.versions = [], [], [], [], []
            e.rewards, e.turns, e.segments = [], [], []
        e.prompt_ids, e.rendered = self.chat.prompt_and_text(view, tools)
        e.messages, e.tools, s.tools, s.view = view, tools, tools, view
        return list(e.prompt_ids)

    async def complete(self, key: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """One chat completion for episode ``key`` (the module docstring); calls of one
        episode made at once are taken in turn (the second, not extending the first's
        reply, starts a new trajectory)."""
        s = self._state(key)
        async with s.lock:
            return await self._complete(key, s, body)

    async def _complete(self, key: str, s: EpisodeCalls, body: Mapping[str, Any]) -> dict:
        spec, limit = self._spec(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        tools = body.get("tools") or None
        if body.get("tool_choice") == "none":
            tools = None
        e = s.episode
        if e.finish is not None:
            raise RequestError(f"the episode has ended ({e.finish})", "messages", e.finish)
        if len(s.calls) >= self.config.max_turns:
            e.end("max_turns")
            raise RequestError(f"max_turns={self.config.max_turns} calls", "messages", "max_turns")
        if e.info.get("tool_calls", 0.0) > self.config.max_tool_calls:
            e.end("max_tool_calls", f"{e.info['tool_calls']:g} tool calls")
            raise RequestError("the episode's tool calls are used up", "messages", "max_tool_calls")
        prompt = self._prompt(s, messages, tools)
        budget = self.config.max_episode_tokens - len(prompt)
        if budget <= 0:
            e.end("max_tokens", f"the prompt has {len(prompt)} tokens")
            raise RequestError("the episode's token budget is used up", "messages", "max_tokens")
        turn = len(s.calls)
        # the episode loop's seeding in a run; a request's own seed alone otherwise
        index = e.index * self.config.max_turns + turn if self.spec is not None else 0
        request = (index, prompt, min(budget, limit or budget))
        try:
            # plain /v1 calls take the servers in turn
            at = e.index if key != DEFAULT else len(self.episodes[DEFAULT].calls)
            r = await self._generate(request, spec, at)
        except Exception as err:  # the servers failed (the pool retried once): HTTP 500
            e.end("agent_error", f"the rollout servers failed: {type(err).__name__}: {err}")
            raise
        ids = [int(t) for t in r["token_ids"]]
        text = r["text"]
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.append("sampled", len(e.turns), ids, r["log_probs"], int(r["version"]))
        e.turns.append({"text": text, "tokens": len(ids), "finish_reason": r["finish_reason"]})
        reply, finish = self._reply(text, ids, str(r["finish_reason"]), spec, tools)
        if reply.get("tool_calls"):  # counted for EpisodeConfig.max_tool_calls and metrics
            e.info["tool_calls"] = e.info.get("tool_calls", 0.0) + len(reply["tool_calls"])
        s.view = [*s.view, {"role": "assistant", "content": text}]
        e.messages = s.view
        s.history = [*(_normal(m) for m in messages), _normal(reply)]
        s.raw[_normal(reply)] = text
        s.last_sampled = ids
        log_probs = np.asarray(r["log_probs"], np.float64)
        record = {
            "prompt_ids": list(prompt),
            "token_ids": ids,
            "log_probs": log_probs.tolist(),
            "version": int(r["version"]),
            "finish_reason": finish,
        }
        s.calls.append(record)
        if key == DEFAULT:
            self.episodes[DEFAULT].calls.append(record)
        choice: dict[str, Any] = {"index": 0, "message": reply, "finish_reason": finish}
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.tokenizer.decode([t]),
                        "logprob": float(lp),
                        "bytes": list(self.tokenizer.decode([t]).encode()),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(ids, log_probs)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }

    def _reply(
        self, text: str, ids: list[int], finish: str, spec: SamplingSpec, tools: Any
    ) -> tuple[dict[str, Any], str]:
        """The assistant message (tool calls parsed when tools were offered) and its
        OpenAI finish reason."""
        finish = "stop" if finish == "stop" else "length"
        content = text
        if ids and ids[-1] in spec.stop_token_ids:  # OpenAI leaves the stop text out
            stop_text = self.tokenizer.decode([ids[-1]])
            content = text[: -len(stop_text)] if text.endswith(stop_text) else text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not tools:
            return message, finish
        from polyrl.envs.parsers import parse_tool_calls

        parsed = parse_tool_calls(content, self.tool_parser)
        if parsed.calls:
            message["content"] = parsed.text or None
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:16]}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
                }
                for c in parsed.calls
            ]
        return message, "tool_calls" if parsed.calls and finish == "stop" else finish

    # ---------------------------------------------------------- generation
    async def _generate(self, request: tuple, spec: SamplingSpec, episode: int) -> dict[str, Any]:
        """One sample: on the asynchronous engine a request of its own on the episode's
        server (as the episode loop picks it); on the synchronous one, calls that arrive
        while a batch is out go in the next batch."""
        if self.pool.config.asynchronous:
            (r,) = await self.pool.generate_on(episode % len(self.pool.servers), [request], spec)
            return r
        future = asyncio.get_running_loop().create_future()
        self.pending.append((request, spec, future))
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            await asyncio.sleep(0.005)  # let the calls of agents in flight arrive
            while self.pending:
                batch, self.pending = self.pending, []
                by_spec: dict[SamplingSpec, list] = {}
                for item in batch:
                    by_spec.setdefault(item[1], []).append(item)
                for spec, items in by_spec.items():
                    try:
                        results = await asyncio.to_thread(
                            self.pool.generate_ids, [i[0] for i in items], spec
                        )
                    except Exception as err:
                        for *_, future in items:
                            future.set_exception(err)
                        continue
                    for (*_, future), r in zip(items, results):
                        future.set_result(r)
        finally:
            self.draining = False

    # ------------------------------------------------------------- records
    def calls(self, episode: str = DEFAULT) -> list[dict[str, Any]]:
        """The recorded calls of ``episode``: prompt ids, sampled ids, their log-probs,
        the weight version and the finish reason of each."""
        return self.episodes[episode].calls

    def pop(self, episode: str) -> EpisodeCalls | None:
        return self.episodes.pop(episode, None)


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"the agent returned {value!r:.80}, not a reward (a number)")
    if not math.isfinite(float(value)):
        raise TypeError(f"the agent returned the reward {value!r}, not a finite number")
    return float(value)


async def _play(endpoint: AgentEndpoint, e: Episode, name: str, agent: Any) -> None:
    import openai

    timeout = endpoint.config.agent_timeout_s
    client = openai.AsyncOpenAI(
        base_url=endpoint.base_url(name), api_key="polyrl", max_retries=0, timeout=timeout
    )
    row = {k: v for k, v in e.row.items()}
    state = endpoint._state(name)
    state.episode = e
    try:
        reward = _reward(await asyncio.wait_for(agent(row, client), timeout))
        if e.ids:
            e.rewards.append((len(e.ids) - 1, reward))
            e.turns[-1]["reward"] = reward
        if e.finish is None:
            e.end("done") if e.ids else e.end("agent_error", "the agent made no model call")
    except TimeoutError:
        if e.finish is None:
            e.end("agent_timeout", f"the agent ran past agent_timeout_s={timeout:g} s")
    except Exception as err:
        if e.finish is None:
            e.end("agent_error", f"the agent raised {type(err).__name__}: {err}"[:2000])
    finally:
        await client.close()
        endpoint.pop(name)
    if e.detail and e.turns:
        e.turns[-1].setdefault("error", e.detail)


def run_agents(endpoint: AgentEndpoint, episodes: Sequence[Episode]) -> None:
    """Play each episode's agent (``polyrl.envs.agents``, by its row's data_source) at
    once on ``endpoint``; each episode ends as the module docstring says. An episode's
    id in its base URL is its key (unique in the run)."""
    from polyrl.envs.agents import get_agent

    async def play_all() -> None:
        await asyncio.gather(
            *(_play(endpoint, e, f"e{e.key}", get_agent(e.row["data_source"])) for e in episodes)
        )

    asyncio.run_coroutine_threadsafe(play_all(), endpoint.loop).result()
    for e in episodes:  # the prompt of an episode whose agent never called the model
        if not e.prompt_ids:
            e.prompt_ids = endpoint.chat.prompt(e.row["prompt"])
