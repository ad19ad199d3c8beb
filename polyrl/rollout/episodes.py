"""Multi-turn episodes on the rollout servers, with exact tokens (docs/agents.md).

An episode is a prompt and a list of turns, each either the model's sampled ids (with
their log-probs and the weight version that sampled them) or an observation's ids (the
chat template's tokens for the messages the env appended: never sampled). Every episode
runs its own turn loop, all of them at once (asyncio in the driver): a turn is one
request to the episode's rollout server (:meth:`RolloutPool.generate_on`; the episode
keeps its server) with the episode's exact ids so far, whose earlier turns vLLM's
prefix cache still holds, then one step of its env in the env workers
(``polyrl.envs.workers``), then the next turn. An episode whose turn is done goes on
without waiting for the others, and the asynchronous engine (``RolloutConfig.engine``)
keeps every episode's request in its running batch: a long episode holds only itself.

Exact tokens. Earlier turns are never re-tokenized: a turn's sampled ids are kept as
sampled, and an observation's ids are the difference of the template applied to the
conversation with and without the new messages (:class:`ChatTokens`), plus the
template's end of the assistant turn that the model did not sample (the newline after
``<|im_end|>`` in Qwen's template; the whole ``<|im_end|>`` when the turn was cut at
``max_tokens``). With ``EpisodeConfig.check_drift`` each finished episode is compared with
a fresh application of the template to its whole conversation; the first position where
they differ is reported with its turn and whether the model sampled it (a sampled text
that the tokenizer would split differently: harmless, the sampled ids are trained) or the
template made it (the observation's tokens in context differ from a fresh rendering).

The output batch has the layout of ``RolloutPool.generate`` (one row per episode, rows
``i*n .. i*n+n-1`` are prompt ``i``'s episodes, ``group_ids`` says which prompt) with the
response being every turn concatenated, and:

    response_mask           [N, R] float32  1 on tokens the policy sampled only
    rollout_log_probs       [N, R] float32  their log-probs, 0 on observation tokens
    rollout_token_versions  [N, R] int32    weight version per sampled token, -1 elsewhere
    token_rewards           [N, R] float32  each turn's reward on its last sampled token
    scores                  [N]    float32  the episode's reward (sum over turns)
    num_turns               [N]    int32
    meta turns              per episode: a list of {"text", "tokens", "finish_reason",
                            "reward", "observation", "observation_tokens",
                            "prompt_tokens", "cached_tokens"} (the dumps)
    meta finish_reason      the episode's (``polyrl.envs.FINISH_REASONS``)
    meta drift              where a fresh rendering first differs ({"position", "turn",
                            "kind"}) or None (``EpisodeConfig.check_drift``)
    meta response_text      the response decoded with its special tokens
    info episode_metrics    this batch's ``episode/...`` metrics (docs/agents.md)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from polyrl.batch import Batch, from_token_lists
from polyrl.envs.base import FINISH_REASONS, EpisodeConfig, Turn
from polyrl.rollout.pool import PROMPT_KEY
from polyrl.rollout.sampling import SamplingSpec
from polyrl.rollout.trajectory import ChatTokens, Episode, TemplateError, first_drift

__all__ = ["ChatTokens", "Episode", "EpisodeRunner", "TemplateError", "first_drift"]

logger = logging.getLogger(__name__)


class EpisodeRunner:
    """Runs a batch of prompts as episodes on ``pool`` with ``envs`` (module docstring)."""

    def __init__(self, pool: Any, envs: Any, tokenizer: Any, config: EpisodeConfig):
        engine = getattr(getattr(pool, "config", None), "engine", "async")
        if engine == "sync":
            raise ValueError(
                f"RolloutConfig.engine={engine!r}: multi-turn episodes run many requests in "
                f"flight on the asynchronous engine; set RolloutConfig.engine='async'"
            )
        self.pool, self.envs, self.config = pool, envs, config
        self.chat = ChatTokens(tokenizer)
        self.tokenizer = tokenizer
        self.warned_drift = False
        self.started = 0  # episodes started so far: the next one's key
        self.endpoint: Any = None  # the OpenAI endpoint of agents' episodes, on first use

    def shutdown(self) -> None:
        self.envs.shutdown()
        if self.endpoint is not None:
            self.endpoint.close()

    # ------------------------------------------------------------------ the loop
    def generate(
        self, prompts: Batch, spec: SamplingSpec, response_len: int | None = None
    ) -> Batch:
        """``spec.n`` episodes of each row of ``prompts`` (meta ``prompt``, ``data_source``,
        ``ground_truth``, ``extra_info``) as one batch (module docstring). ``response_len``:
        the response width (default ``max_episode_tokens``)."""
        t0 = time.monotonic()
        episodes = self.start(prompts, spec)
        t1 = time.monotonic()
        asyncio.run(self._play(episodes, spec))
        t2 = time.monotonic()
        self.finish(episodes)
        t3 = time.monotonic()
        batch = self.assemble(prompts.repeat(spec.n), episodes, spec, response_len)
        last = max((e.span[1] for e in episodes if e.span is not None), default=t2)
        batch.info["episode_metrics"] |= {
            "episode/start_s": t1 - t0,
            "episode/close_out_s": t2 - last,  # the last answer to the loop's end
            "episode/finish_s": t3 - t2,
            "episode/assemble_s": time.monotonic() - t3,
        }
        return batch

    def start(self, prompts: Batch, spec: SamplingSpec, first_row: int = 0) -> list[Episode]:
        """The episodes of ``prompts`` (rows ``first_row``... of their data batch: episode
        ``(first_row + i) * n + j`` is row ``i``'s sample ``j``, which seeds its turns);
        those of OpenAI-client agents are played to their end here
        (``polyrl.rollout.openai_endpoint``), the envs' are reset."""
        from polyrl.envs.agents import AGENTS

        prompts.require("prompt", "data_source", who="EpisodeRunner")
        episodes, n = [], spec.n
        for i in range(len(prompts)):
            row = {
                k: prompts[k][i]
                for k in ("prompt", "ground_truth", "data_source", "extra_info")
                if k in prompts
            }
            for j in range(n):  # (a batch may run while another does: async, validation)
                index = (first_row + i) * n + j
                episodes.append(Episode(index, self.started, {**row, "sample": j}))
                self.started += 1
        played = [e for e in episodes if e.row["data_source"] in AGENTS]
        if played:
            self._play_agents(played, spec)
        envs = [e for e in episodes if e.row["data_source"] not in AGENTS]
        results = self.envs.reset([(e.key, e.row["data_source"], e.row) for e in envs])
        last: Episode | None = None
        for e, r in zip(envs, results):
            e.messages = list(r.get("messages") or [dict(m) for m in e.row["prompt"]])
            e.tools = r.get("tools")
            if last is not None and (e.messages, e.tools) == (last.messages, last.tools):
                # a row's samples: one rendering (the ids are never mutated)
                e.prompt_ids, e.rendered = last.prompt_ids, last.rendered
            else:
                e.prompt_ids, e.rendered = self.chat.prompt_and_text(e.messages, e.tools)
            last = e
            if "error" in r:
                e.end(r["error"], r["detail"])
            elif e.length >= self.config.max_episode_tokens:
                e.end("max_tokens", f"the prompt has {e.length} tokens")
        return episodes

    def _play_agents(self, episodes: list[Episode], spec: SamplingSpec) -> None:
        from polyrl.rollout.openai_endpoint import AgentEndpoint, run_agents

        if self.endpoint is None:
            self.endpoint = AgentEndpoint(self.pool, self.tokenizer, self.config, spec)
        self.endpoint.spec = spec  # validation samples with its own spec
        run_agents(self.endpoint, episodes)

    def finish(self, episodes: list[Episode]) -> None:
        """Ended episodes: their envs closed unless done; those not closed out as they
        ended (:meth:`ended`) closed out."""
        self.envs.close([e.key for e in episodes if e.finish != "done"])
        self.close_out([e for e in episodes if e.text is None])

    async def ended(self, e: Episode) -> None:
        """``e``'s turns are over: it is closed out in a thread while the other episodes
        play on (the tokenizer's Rust calls release the GIL), not after the last one."""
        await asyncio.to_thread(self.close_out, [e])

    def close_out(self, episodes: list[Episode]) -> None:
        """Ended episodes' response texts and, with ``EpisodeConfig.check_drift``, their
        drift (:meth:`_check_drift`): the generate phase's longest steps after the play
        when done for the whole batch at its end (0.5-0.8 s for 512 episodes of ~1.7k
        tokens on one core)."""
        if self.config.check_drift:
            self._check_drift(episodes)
        for e in episodes:
            e.text = self.tokenizer.decode(e.ids, skip_special_tokens=False)

    async def _play(self, episodes: list[Episode], spec: SamplingSpec) -> None:
        await asyncio.gather(*(self._episode(e, spec) for e in episodes if e.finish is None))

    async def _episode(self, e: Episode, spec: SamplingSpec) -> None:
        """One episode's turns until it ends, whatever the other episodes do."""
        for turn in range(self.config.max_turns):
            if e.finish is not None:
                break
            await self.play_turn(e, turn, spec)
        await self.ended(e)

    async def play_turn(self, e: Episode, turn: int, spec: SamplingSpec) -> None:
        """Turn ``turn`` of ``e``: :meth:`sample_turn`, then :meth:`step_env`."""
        await self.step_env(e, turn, await self.sample_turn(e, turn, spec))

    async def sample_turn(self, e: Episode, turn: int, spec: SamplingSpec) -> Turn:
        """Sample turn ``turn`` of ``e``: its exact ids so far, on its own server (whose
        prefix cache holds its earlier turns). Turn ``t`` of episode ``i`` is seeded by
        ``i * max_turns + t``."""
        limit, max_turns = self.config.max_episode_tokens, self.config.max_turns
        request = (e.index * max_turns + turn, e.prompt_ids + e.ids, limit - e.length)
        start = time.monotonic()
        (r,) = await self.pool.generate_on(e.index % len(self.pool.servers), [request], spec)
        e.timed("sampling", start)
        sampled = self._sampled(e, turn, r)
        # how much of this turn's prompt the server's prefix cache held
        e.turns[-1].update(prompt_tokens=len(request[1]), cached_tokens=r.get("cached_tokens", 0))
        return sampled

    async def step_env(self, e: Episode, turn: int, sampled: Turn) -> None:
        """Step ``e``'s env with its sampled turn and append the observation."""
        start = time.monotonic()
        self._observe(e, turn, await self.envs.step_one(e.key, sampled))
        e.timed("env", start)

    def _sampled(self, e: Episode, turn: int, r: Mapping[str, Any]) -> Turn:
        """Append a sampled turn to ``e``; the :class:`Turn` its env steps with."""
        ids = [int(t) for t in r["token_ids"]]
        versions = r.get("token_versions")  # per token when a push continued it in place
        e.append(
            "sampled",
            turn,
            ids,
            r["log_probs"],
            int(r["version"]) if versions is None else versions,
        )
        text = r["text"]
        if text is None:  # SamplingSpec.detokenize=False
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        e.turns.append({"text": text, "tokens": len(ids), "finish_reason": r["finish_reason"]})
        return Turn(text, tuple(ids), turn, str(r["finish_reason"]))

    def _observe(self, e: Episode, turn: int, out: Mapping[str, Any]) -> None:
        if "error" in out:
            e.turns[-1]["error"] = out["detail"]
            e.end(out["error"], out["detail"])
            return
        e.rewards.append((len(e.ids) - 1, out["reward"]))  # the turn's last sampled token
        e.turns[-1]["reward"] = out["reward"]
        for k, v in out["info"].items():
            e.info[k] = e.info.get(k, 0.0) + v
        if out["done"]:
            return e.end("done")
        if e.info.get("tool_calls", 0.0) > self.config.max_tool_calls:
            return e.end("max_tool_calls", f"{e.info['tool_calls']:g} tool calls")
        if turn + 1 >= self.config.max_turns:
            return e.end("max_turns")
        sampled = e.ids[len(e.ids) - e.turns[-1]["tokens"] :]
        try:
            obs, rendered = self.chat.observation(
                e.messages, out["observation"], e.tools, sampled, e.rendered
            )
        except TemplateError as err:
            return e.end("template_error", str(err))
        if e.length + len(obs) >= self.config.max_episode_tokens:
            return e.end("max_tokens", f"an observation of {len(obs)} tokens does not fit")
        e.append("observation", turn, obs, np.zeros(len(obs)), -1)
        e.messages.extend(out["observation"])
        e.rendered = rendered
        e.turns[-1]["observation"] = out["observation"]
        e.turns[-1]["observation_tokens"] = len(obs)

    def _check_drift(self, episodes: list[Episode]) -> None:
        """Each episode against the template applied to its whole conversation, the
        renderings tokenized in one batch (~1.4 ms an episode of 1.7k tokens one at a time
        on a 2-core host)."""
        rendered, texts = [], []
        for e in episodes:
            try:
                texts.append(self.chat.render(e.messages, e.tools, False))
                rendered.append(e)
            except Exception as err:  # a template that cannot render its own conversation
                e.drift = {"position": 0, "turn": -1, "kind": "template", "error": str(err)}
        for e, fresh in zip(rendered, self.chat.encode_many(texts)):
            e.drift = first_drift(e.prompt_ids + e.ids, fresh, e.segments)
            if e.drift and e.drift["kind"] != "sampled" and not self.warned_drift:
                self.warned_drift = True
                logger.warning(
                    "episode %d of the batch: the chat template applied to the whole "
                    "conversation gives other tokens than the episode's from position %d "
                    '(turn %d, %s tokens); the episode trains on its own ids (docs/agents.md "Exact '
                    'tokens")',
                    e.index,
                    e.drift["position"],
                    e.drift["turn"],
                    e.drift["kind"],
                )

    # --------------------------------------------------------------- the batch
    def assemble(
        self, rep: Batch, episodes: list[Episode], spec: SamplingSpec, width: int | None = None
    ) -> Batch:
        """Ended ``episodes`` (the rows of ``rep``, prompts repeated) as one batch, the
        responses ``width`` tokens wide (default ``max_episode_tokens``)."""
        _check_sampled(episodes, self.config)
        width = self.config.max_episode_tokens if width is None else width
        batch = episode_columns(rep, episodes, width, self.pool.pad_token_id, self.pool.version)
        info = self.pool.sample_info(spec, []) | {"episode_metrics": self.metrics(episodes)}
        return batch.with_columns(**info)

    def metrics(self, episodes: list[Episode]) -> dict[str, float]:
        """The ``episode/...`` metrics of a batch (docs/agents.md "Metrics")."""
        n = len(episodes)
        total = lambda key: sum(e.info.get(key, 0.0) for e in episodes)  # noqa: E731
        calls, response = total("tool_calls"), sum(len(e.ids) for e in episodes)
        observed = sum(len(e.ids) - sum(e.sampled) for e in episodes)
        turns = [t for e in episodes for t in e.turns]
        later = [t for e in episodes for t in e.turns[1:]]  # turns that continue an episode
        out = {
            "episode/turns_mean": sum(len(e.turns) for e in episodes) / n,
            "episode/length_mean": sum(e.length for e in episodes) / n,
            "episode/observation_token_share": observed / max(response, 1),
            "episode/turn_cut_share": sum(t["finish_reason"] == "length" for t in turns)
            / max(len(turns), 1),
            "episode/tool_calls_mean": calls / n,
            "episode/tool_errors_mean": total("tool_errors") / n,
            "episode/tool_error_share": total("tool_errors") / calls if calls else 0.0,
            "episode/tool_latency_s": total("tool_seconds") / calls if calls else 0.0,
            "episode/tools_offered": float(any(e.tools for e in episodes)),
            "episode/prefix_cache_share": sum(t.get("cached_tokens", 0) for t in later)
            / max(sum(t.get("prompt_tokens", 0) for t in later), 1),
            "episode/history_rewrite_share": sum(
                bool(e.info.get("history_rewrites")) for e in episodes
            )
            / n,
        }
        out |= in_flight(episodes)
        for reason in FINISH_REASONS:
            out[f"episode/finish/{reason}"] = sum(e.finish == reason for e in episodes) / n
        # what the rewrites changed (openai_endpoint.rewrite_reasons): the share of episodes
        rewrites = sorted({k for e in episodes for k in e.info if k.startswith("rewrite/")})
        for key in rewrites:
            out[f"episode/{key}"] = sum(bool(e.info.get(key)) for e in episodes) / n
        if self.config.check_drift:
            drifted = [e.drift for e in episodes if e.drift]
            out["episode/drift_share"] = len(drifted) / n
            out["episode/template_drift_share"] = sum(d["kind"] != "sampled" for d in drifted) / n
        return out


def in_flight(episodes: list[Episode]) -> dict[str, float]:
    """How many of ``episodes`` had a turn at the rollout servers (``sampling``) and in an
    env step (``env``) on average over the batch's play, from its first request to its
    last answer: the seconds each spent so, summed, over the play's seconds (a batch of
    single-turn requests holds all of them at the servers until they end). Empty when no
    episode was timed (agents' episodes run through the OpenAI endpoint)."""
    spans = [e.span for e in episodes if e.span is not None]
    if not spans:
        return {}
    play = max(end for _, end in spans) - min(start for start, _ in spans)
    out = {"episode/play_s": play}
    for what in ("sampling", "env"):
        busy = sum(e.seconds.get(what, 0.0) for e in episodes)
        out[f"episode/{what}_in_flight_mean"] = busy / play if play > 0 else 0.0
    return out


def episode_columns(
    rep: Batch, episodes: list[Episode], width: int, pad_token_id: int, version: int
) -> Batch:
    """``rep`` (one row per episode) with the episodes' sequence layout
    (``polyrl.batch``), the responses at least ``width`` tokens wide, and their columns:
    the sampled tokens' mask, log-probs and weight versions, the rewards on their tokens,
    lengths, turns; a row's weight version is its oldest sampled token's (``version``
    for a row with none)."""
    seq = from_token_lists(
        [e.prompt_ids for e in episodes],
        [e.ids for e in episodes],
        pad_token_id,
        response_len=max(width, max(len(e.ids) for e in episodes)),
    )
    shape = seq["responses"].shape
    mask = np.zeros(shape, np.float32)
    log_probs = np.zeros(shape, np.float32)
    versions = np.full(shape, -1, np.int32)
    rewards = np.zeros(shape, np.float32)
    for row, e in enumerate(episodes):
        n = len(e.ids)
        mask[row, :n] = e.sampled
        log_probs[row, :n] = e.log_probs
        versions[row, :n] = e.versions
        for pos, r in e.rewards:
            rewards[row, pos] += r
    sampled = mask > 0
    versions[~sampled] = -1  # observation tokens
    oldest = np.where(sampled, versions, np.iinfo(np.int32).max).min(-1)
    tensors = {
        **seq.tensors,
        "response_mask": mask,
        "rollout_log_probs": log_probs,
        "rollout_token_versions": versions,
        "token_rewards": rewards,
        "scores": rewards.sum(-1),
        "response_lengths": np.array([len(e.ids) for e in episodes], np.int32),
        "prompt_lengths": np.array([len(e.prompt_ids) for e in episodes], np.int32),
        "rollout_weight_version": np.where(sampled.any(-1), oldest, version).astype(np.int64),
        "num_turns": np.array([len(e.turns) for e in episodes], np.int32),
    }
    meta = {
        PROMPT_KEY: [e.prompt_ids for e in episodes],
        "finish_reason": [e.finish for e in episodes],
        "turns": [e.turns for e in episodes],
        "drift": [e.drift for e in episodes],
        "response_text": [e.text for e in episodes],
    }
    return rep.with_columns(tensors, meta)


def placeholder(prompts: Batch, spec: SamplingSpec, config: EpisodeConfig, tokenizer: Any) -> Batch:
    """The batch :meth:`EpisodeRunner.generate` returns for ``prompts``, sampling
    nothing: the trainer's warm-up (``RunConfig.warm_up``) before the servers and envs
    are up. Each row's prompt is its messages as the chat template renders them (an
    env's reset that adds messages or tools makes the real prompts longer: a real batch
    in another padded prompt width compiles its programs in step 1); each episode one
    turn of ``spec.max_tokens`` sampled tokens of id 0 (as many as fit), but unless
    ``spec.ignore_eos`` the first of each prompt's is one token long (rows with and
    without padding, as real episodes of different lengths), in the columns
    ``max_episode_tokens`` wide."""
    chat, episodes, n = ChatTokens(tokenizer), [], spec.n
    for i, messages in enumerate(prompts["prompt"]):
        prompt = chat.prompt(messages)
        room = max(config.max_episode_tokens - len(prompt), 0)
        for j in range(n):
            e = Episode(i * n + j, -1, {}, prompt_ids=prompt)
            k = min(1 if j == 0 and not spec.ignore_eos else spec.max_tokens, room)
            e.append("sampled", 0, [0] * k, [0.0] * k, -1)
            e.turns.append({"text": "", "tokens": k, "finish_reason": "length"})
            e.end("max_turns")
            episodes.append(e)
    return episode_columns(prompts.repeat(n), episodes, config.max_episode_tokens, 0, -1)


def _check_sampled(episodes: list[Episode], config: EpisodeConfig) -> None:
    """A batch in which no episode got to sample a token has nothing to train on: say
    why (the episodes' finish reasons) instead of the trainer's empty-mask error."""
    if any(e.ids for e in episodes):
        return
    reasons: dict[str, int] = {}
    for e in episodes:
        reasons[str(e.finish)] = reasons.get(str(e.finish), 0) + 1
    first = next((e for e in episodes if e.detail), episodes[0])
    hint = (
        f"; the first messages (the env's reset, with its system message and tools) do not "
        f"fit in EpisodeConfig.max_episode_tokens={config.max_episode_tokens}: raise it (and "
        f"RolloutConfig.max_model_len) or shorten the prompt"
        if "max_tokens" in reasons
        else ""
    )
    raise RuntimeError(
        f"no episode of the batch sampled a token: they ended {reasons} before the first "
        f"turn (episode {first.index}: {first.finish}: {first.detail}){hint}"
    )
