"""LLM-judge rewards: a model served by vLLM reads each response and says how good it is.

``polyrl.RunConfig.judge = @polyrl.JudgeConfig()`` turns it on for an RL run
(docs/rewards.md "Reward models and judges"). At the reward stage of every step,
:class:`Judge` renders ``JudgeConfig.template`` for each response (``{prompt}``: the row's
prompt messages' text, ``{response}``, ``{ground_truth}``) as one user message in the
judge model's chat template, sends the whole step's requests to the judge's servers together
(one batched call), reads a score from each reply with ``JudgeConfig.parser`` (a name in
:data:`PARSERS`; ``"regex"``: the first group of ``JudgeConfig.pattern``), checks it lies
in ``[min_score, max_score]`` and maps it to ``[0, 1]``. A reply with no readable score in
range is *malformed*; a round of requests that has not returned within ``timeout_s`` is
aborted and all its requests are *timed out* (vLLM's asynchronous engine, the CPU default,
stops them at once; the synchronous one, GPU single-turn runs' default, finishes its call
first). Either is asked again, at most ``retries`` more times; a sample still without
a score gets ``fallback`` (a *failed* judgement). Each response's reward is its rule
reward (+ the reward model's) + ``coef`` x its judge score.

The judge's servers: by default the run's own rollout pool, i.e. the policy being trained
(a self-rewarding setup; with ``RunConfig.model_path`` a strong model, the judge is that
model before training moves it): the pool must be idle at the reward stage, so such a
run generates no batch ahead (``max_staleness = 0``, no ``streaming``). With
``JudgeConfig.model_path``, a pool of its own: the frozen role ``judge``
(``polyrl.role_table``), a second ``RolloutPool`` of that model, built and placed as the
rollout's (``polyrl.cluster.roles``, ``polyrl.cluster.placement``) from
:meth:`JudgeConfig.servers`, prompted through its own tokenizer; generation never asks it,
so rollouts may run ahead and stream (every judgement is asked from the trainer's thread).

Metrics of a step (its own batches' judgements; validation's are not counted):
``judge/requests``, ``judge/malformed``, ``judge/timed_out``, ``judge/failed`` (counts)
and ``judge/score_mean`` (the mean judge score in [0, 1], fallbacks included). The raw
replies of each sample, one per attempt (``<timed out>`` for a lost one), go into
``rollouts.jsonl`` (``judge``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from polyrl.role_table import DEFAULT_POOL

__all__ = [
    "DEFAULT_TEMPLATE",
    "PARSERS",
    "Judge",
    "JudgeConfig",
    "register_judge_parser",
    "render",
]

DEFAULT_TEMPLATE = (
    "Rate the response to the task from 0 to 10.\n"
    "Task: {prompt}\nResponse: {response}\n"
    "Reply with 'score: N'."
)
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")

# parser name -> fn(reply text, JudgeConfig.pattern) -> the score, or None (malformed)
Parser = Callable[[str, str], "float | None"]
PARSERS: dict[str, Parser] = {}


def register_judge_parser(name: str) -> Callable[[Parser], Parser]:
    """Decorator: ``JudgeConfig.parser = name`` reads scores with the function
    ``fn(reply, pattern) -> float | None`` (None: the reply is malformed)."""

    def deco(fn: Parser) -> Parser:
        PARSERS[name] = fn
        return fn

    return deco


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if np.isfinite(value) else None


@register_judge_parser("regex")
def parse_regex(reply: str, pattern: str) -> float | None:
    """The first capture group (else the whole match) of ``pattern``'s first match in
    ``reply`` as a number; None when nothing matches or it is not a finite number."""
    found = re.search(pattern, reply)
    if found is None:
        return None
    return _number(found.group(1) if found.groups() else found.group(0))


@register_judge_parser("json")
def parse_json(reply: str, pattern: str) -> float | None:
    """The number under key ``pattern`` (e.g. ``score``) of the first JSON object in the
    reply; None when there is none or it holds no finite number there."""
    start = reply.find("{")
    while start != -1:
        try:
            obj, _ = json.JSONDecoder().raw_decode(reply[start:])
        except json.JSONDecodeError:
            start = reply.find("{", start + 1)
            continue
        value = obj.get(pattern) if isinstance(obj, dict) else None
        return None if isinstance(value, bool) else _number(value)
    return None


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """An LLM judge (``polyrl.RunConfig.judge = @polyrl.JudgeConfig()``; module docstring).

    template: the judge's user message; ``{prompt}``, ``{response}``, ``{ground_truth}``
      are filled in (write ``{{`` / ``}}`` for literal braces).
    parser / pattern: how a score is read from a reply: a :data:`PARSERS` name
      (``"regex"``: ``pattern`` is a regular expression whose first group is the score;
      ``"json"``: ``pattern`` is the key of the score in the reply's first JSON object),
      or one registered with :func:`register_judge_parser` in a module given to
      ``--import``.
    min_score / max_score: the judge's scale; a score outside it is malformed, one inside
      maps linearly to [0, 1].
    coef: the judge score's weight in the reward (added to the rule reward).
    max_tokens / temperature: the judge's sampling (greedy by default).
    retries: how many more times a malformed or timed-out judgement is asked, sampled at
      ``retry_temperature`` (a greedy judge would repeat a malformed reply word for word)
      with a new seed each time.
    timeout_s: each round of the step's judge requests.
    fallback: the judge score (in [0, 1]) of a sample still without one after the retries.
    model_path: a local HF directory (model + tokenizer): the judge is that model on vLLM
      servers of its own (role ``judge``), frozen (no weights are ever pushed to it),
      prompted through its own tokenizer's chat template; they run as the run's
      ``RolloutConfig`` says except for the fields below. None: the run's own rollout
      pool judges (the policy being trained).
    num_servers / tensor_parallel_size / pool: the judge's servers, GPUs per server and
      the ``RunConfig.pools`` entry they run in (placed like the rollout servers; in a pool
      with other roles they share its devices and never sleep).
    gpu_memory_utilization: the fraction of each GPU a judge server's vLLM takes; None:
      ``RolloutConfig.gpu_memory_utilization`` (in the rollout's pool, lower both so that
      they fit side by side).
    """

    template: str = DEFAULT_TEMPLATE
    parser: str = "regex"
    pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    min_score: float = 0.0
    max_score: float = 10.0
    coef: float = 1.0
    max_tokens: int = 32
    temperature: float = 0.0
    retries: int = 2
    retry_temperature: float = 1.0
    timeout_s: float = 60.0
    fallback: float = 0.0
    model_path: str | None = None
    num_servers: int = 1
    tensor_parallel_size: int = 1
    pool: str = DEFAULT_POOL
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        from polyrl.errors import raise_if_problems

        out = []
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        except ValueError as e:
            fields, problem = set(), f"JudgeConfig.template cannot be formatted ({e})"
            out.append(f"{problem}; write literal braces as {{{{ and }}}}")
        unknown = sorted(fields - set(TEMPLATE_FIELDS))
        if unknown:
            out.append(
                f"JudgeConfig.template has unknown field(s) {unknown}; the fields are "
                f"{list(TEMPLATE_FIELDS)} (write literal braces as {{{{ and }}}})"
            )
        if "response" not in fields and not out:
            out.append(
                "JudgeConfig.template has no {response} field: the judge would never see "
                "the response it scores"
            )
        if self.parser not in PARSERS:
            out.append(
                f"JudgeConfig.parser={self.parser!r} is not a parser; use one of "
                f"{sorted(PARSERS)} or register one with "
                f"@polyrl.loop.judge.register_judge_parser({self.parser!r}) in a --import module"
            )
        if self.parser == "regex":
            try:
                re.compile(self.pattern)
            except re.error as e:
                out.append(
                    f"JudgeConfig.pattern={self.pattern!r} is not a regular expression ({e})"
                )
        if not self.max_score > self.min_score:
            out.append(
                f"JudgeConfig.min_score={self.min_score} / max_score={self.max_score}: "
                "max_score must be above min_score (e.g. 0 and 10)"
            )
        for name, low in (("retries", 0), ("max_tokens", 1), ("num_servers", 1)):
            if getattr(self, name) < low:
                out.append(f"JudgeConfig.{name}={getattr(self, name)} must be >= {low}")
        if self.temperature < 0 or self.retry_temperature < 0:
            out.append(
                f"JudgeConfig.temperature={self.temperature} / retry_temperature="
                f"{self.retry_temperature} must be >= 0 (0: greedy)"
            )
        if self.tensor_parallel_size < 1:
            out.append(
                f"JudgeConfig.tensor_parallel_size={self.tensor_parallel_size} must be >= 1 "
                "(GPUs per judge server; 1 on CPU)"
            )
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            out.append(
                f"JudgeConfig.gpu_memory_utilization={share} must be in (0, 1] (a fraction of "
                "each GPU), or None for RolloutConfig.gpu_memory_utilization"
            )
        if not self.timeout_s > 0:
            out.append(f"JudgeConfig.timeout_s={self.timeout_s} must be > 0 (seconds)")
        if not 0.0 <= self.fallback <= 1.0:
            out.append(f"JudgeConfig.fallback={self.fallback} must be in [0, 1] (a judge score)")
        raise_if_problems(out)

    def servers(self, rollout: Any) -> Any:
        """The ``RolloutConfig`` of the judge's own servers: the run's ``rollout`` with this
        judge's model, servers and pool, never asleep, on the asynchronous engine (a
        round past ``timeout_s`` is aborted at once)."""
        return dataclasses.replace(
            rollout,
            model_path=self.model_path,
            num_servers=self.num_servers,
            tensor_parallel_size=self.tensor_parallel_size,
            pool=self.pool,
            gpu_memory_utilization=self.gpu_memory_utilization or rollout.gpu_memory_utilization,
            enable_sleep_mode=False,
            continue_in_place=False,
            engine="async",
        )

    def score_of(self, reply: str) -> float | None:
        """The reply's judge score in [0, 1], or None (malformed)."""
        raw = PARSERS[self.parser](reply, self.pattern)
        if raw is None or not self.min_score <= raw <= self.max_score:
            return None
        return (raw - self.min_score) / (self.max_score - self.min_score)


def render(template: str, prompt: Sequence[Mapping[str, str]] | str, response: str, truth: str):
    """``template`` filled in for one sample; ``prompt``: the row's chat messages (their
    contents, one per line) or a text."""
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return template.format(prompt=text, response=response, ground_truth=truth)


class Judge:
    """Scores a batch's responses with ``config`` on ``pool`` (the run's ``RolloutPool``,
    idle while the trainer rewards: no rollout runs ahead, validate-config checks it; or
    the judge's own); ``tokenizer``: the judge model's (its chat template renders the
    request)."""

    def __init__(self, config: JudgeConfig, pool: Any, tokenizer: Any):
        from polyrl.rollout.sampling import SamplingSpec

        self.config, self.pool, self.tokenizer = config, pool, tokenizer
        self.spec = SamplingSpec(
            n=1, temperature=config.temperature, max_tokens=config.max_tokens, seed=0
        )
        self.totals: dict[str, float] = {}

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the judgements since the last call (module docstring)."""
        t, self.totals = self.totals, {}
        if not t:
            return {}
        out = {f"judge/{k}": t[k] for k in ("requests", "malformed", "timed_out", "failed")}
        return out | {"judge/score_mean": t["score_sum"] / max(t["samples"], 1.0)}

    def requests(self, batch: Any) -> list[list[int]]:
        """Each sample's judge request as token ids; a ValueError names a sample whose
        request leaves the judge no room to reply."""
        from polyrl.data.prompts import encode_prompt

        c, limit = self.config, self.pool.config.max_model_len
        out = []
        for i, (prompt, response, truth) in enumerate(
            zip(batch["prompt"], batch["response_text"], batch["ground_truth"])
        ):
            text = render(c.template, prompt, response, truth)
            ids = encode_prompt(self.tokenizer, [{"role": "user", "content": text}])
            if len(ids) + c.max_tokens > limit:
                raise ValueError(
                    f"the judge request of sample {i} has {len(ids)} tokens + "
                    f"JudgeConfig.max_tokens={c.max_tokens} > RolloutConfig.max_model_len="
                    f"{limit}; shorten JudgeConfig.template or raise max_model_len"
                )
            out.append(ids)
        return out

    def _round(
        self, requests: list[tuple[int, list[int]]], attempt: int
    ) -> list[dict[str, Any] | None]:
        """One round: every request at once, their results; past ``timeout_s`` the round's
        requests are aborted and all are None (timed out)."""
        c = self.config
        spec = self.spec
        if attempt:
            spec = dataclasses.replace(spec, temperature=c.retry_temperature, seed=attempt)
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="polyrl-judge")
        call = executor.submit(self.pool.generate_ids, requests, spec)
        executor.shutdown(wait=False)
        try:
            return list(call.result(timeout=c.timeout_s))
        except concurrent.futures.TimeoutError:
            pass
        # Abort until the call returns: requests still on their way are stopped as they
        # reach a server. (validate-config: nothing else is in flight on the pool, the
        # rollout's idle at the reward stage, the judge's own asked by one thread.)
        while not call.done():
            self.pool.abort()
            concurrent.futures.wait([call], timeout=0.05)
        call.result()  # (a failure of the call is raised, not counted)
        return [None] * len(requests)

    def score(self, batch: Any) -> tuple[np.ndarray, list[list[str]]]:
        """(judge scores [B] in [0, 1], each sample's raw replies, one per attempt); the
        counts go to :meth:`take_metrics`."""
        c = self.config
        ids = self.requests(batch)
        scores: list[float | None] = [None] * len(ids)
        replies: list[list[str]] = [[] for _ in ids]
        counts = dict.fromkeys(("requests", "malformed", "timed_out"), 0)
        pending = list(range(len(ids)))
        for attempt in range(1 + c.retries):
            if not pending:
                break
            results = self._round([(i, ids[i]) for i in pending], attempt)
            counts["requests"] += len(pending)
            still = []
            for i, result in zip(pending, results):
                if result is None:
                    counts["timed_out"] += 1
                    replies[i].append("<timed out>")
                    still.append(i)
                    continue
                replies[i].append(result["text"])
                scores[i] = c.score_of(result["text"])
                if scores[i] is None:
                    counts["malformed"] += 1
                    still.append(i)
            pending = still
        final = np.array([c.fallback if s is None else s for s in scores], np.float32)
        counts |= {"failed": len(pending), "score_sum": float(final.sum()), "samples": len(ids)}
        for k, v in counts.items():
            self.totals[k] = self.totals.get(k, 0.0) + float(v)
        return final, replies
