"""The OpenAI-compatible endpoint on real rollout servers (vLLM CPU), with the real
``openai`` client, and agents' episodes through the episode loop."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re

import numpy as np
import openai
import pytest

from polyrl.batch import Batch
from polyrl.envs import AGENTS, EpisodeConfig, register_agent
from polyrl.envs.workers import EnvPool
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.openai_endpoint import AgentEndpoint
from polyrl.rollout.sampling import SamplingSpec

# The tiny template with a system turn listing the offered tools' names (the tiny
# template itself ignores tools, as a template without a tools branch would).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system:' }}{% for t in tools %}"
    "{{ t['function']['name'] + ' ' }}{% endfor %}{{ '<|im_end|>' }}{% endif %}"
)
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(padded_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(padded_model_dir)
    tok.chat_template = TOOLS_TEMPLATE + tok.chat_template
    return tok


def _template_ids(tokenizer, messages, tools=None):
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_endpoint_serves_the_openai_client(pool, tokenizer):
    """/v1/models and chat completions with and without tools; the recorded prompt is
    the template's (with the tools), the recorded ids and log-probs are what the servers
    sample for that prompt and seed, and the reply is their text."""
    endpoint = AgentEndpoint(pool, tokenizer, EpisodeConfig(max_episode_tokens=96))
    try:
        client = openai.OpenAI(base_url=endpoint.base_url(), api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["polyrl"]
        messages = [{"role": "user", "content": "secret"}]
        for tools in (None, [CALC]):
            extra = {"tools": tools} if tools else {}
            reply = client.chat.completions.create(
                model="polyrl", messages=messages, max_tokens=6, seed=5, logprobs=True, **extra
            )
            call = endpoint.calls()[-1]
            assert call["prompt_ids"] == _template_ids(tokenizer, messages, tools)
            # the same request straight to the pool: same seed -> the same sample
            (direct,) = pool.generate_ids(
                [(0, call["prompt_ids"], 6)], SamplingSpec(max_tokens=6, seed=5)
            )
            assert call["token_ids"] == direct["token_ids"].tolist()
            np.testing.assert_allclose(call["log_probs"], direct["log_probs"], rtol=1e-6)
            choice = reply.choices[0]
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(call["log_probs"])
            assert choice.message.content == direct["text"]
            assert choice.finish_reason == (
                "stop" if direct["finish_reason"] == "stop" else "length"
            )
            assert reply.usage.completion_tokens == len(call["token_ids"])
        assert endpoint.calls()[0]["prompt_ids"] != endpoint.calls()[1]["prompt_ids"]
        # a refused request names its field, as OpenAI does
        with pytest.raises(openai.BadRequestError, match="n=2"):
            client.chat.completions.create(model="polyrl", messages=messages, n=2)
    finally:
        endpoint.close()


def test_a_call_that_extends_the_episode_renders_the_conversation_twice(
    pool, tokenizer, monkeypatch
):
    """An episode's first call renders its messages once; each later call that extends
    it renders the conversation closed after the last reply and with the new messages,
    extending the last call's rendering kept on the episode (three renders a call
    before: the last call's messages were rendered again)."""
    renders = []
    render = tokenizer.apply_chat_template
    monkeypatch.setattr(
        tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or render(*a, **k)
    )
    endpoint = AgentEndpoint(pool, tokenizer, EpisodeConfig(max_episode_tokens=96))
    try:
        client = openai.OpenAI(base_url=endpoint.base_url("ep"), api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "secret"}]
        for k in range(3):
            reply = client.chat.completions.create(
                model="polyrl", messages=messages, max_tokens=4, seed=k
            )
            messages += [reply.choices[0].message, {"role": "user", "content": "+" * (k + 1)}]
        calls = endpoint.calls("ep")
    finally:
        endpoint.close()
    assert len(calls) == 3
    # the calls extend each other: one trajectory, each prompt the last one's + reply + more
    for a, b in zip(calls, calls[1:]):
        assert b["prompt_ids"][: len(a["prompt_ids"])] == a["prompt_ids"]
        assert b["prompt_ids"][len(a["prompt_ids"]) :][: len(a["token_ids"])] == a["token_ids"]
    assert len(renders) == 1 + 2 * 2


def test_an_agents_calls_do_not_wait_for_another_agents_call(pool, tokenizer):
    """On the asynchronous engine each call is its own request: agent B makes two
    one-token calls, one after the other, while agent A's single call samples 96 tokens
    (a seed whose reply runs to the limit), and B is done first. When calls were batched,
    B's first call waited for A's whole batch. (Three calls of B took as long as A's 96
    tokens once on the loaded 2-core machine, 0.45 ms behind: two leave a margin and
    still fail batching, which makes B's first call wait for all of A.)"""
    endpoint = AgentEndpoint(pool, tokenizer, EpisodeConfig(max_episode_tokens=128))
    messages = [{"role": "user", "content": "secret"}]
    try:
        probe = openai.OpenAI(base_url=endpoint.base_url(), api_key="x", max_retries=0)
        seed = next(
            s
            for s in range(60)
            if probe.chat.completions.create(
                model="polyrl", messages=messages, max_tokens=96, seed=s
            )
            .choices[0]
            .finish_reason
            == "length"
        )

        async def both() -> tuple[list[float], float]:
            loop = asyncio.get_running_loop()
            a = openai.AsyncOpenAI(base_url=endpoint.base_url("a"), api_key="x", max_retries=0)
            b = openai.AsyncOpenAI(base_url=endpoint.base_url("b"), api_key="x", max_retries=0)

            async def long_call() -> float:
                reply = await a.chat.completions.create(
                    model="polyrl", messages=messages, max_tokens=96, seed=seed
                )
                assert reply.usage.completion_tokens == 96
                return loop.time()

            async def short_calls() -> list[float]:
                done, history = [], list(messages)
                for k in range(2):
                    reply = await b.chat.completions.create(
                        model="polyrl", messages=history, max_tokens=1, seed=k
                    )
                    history += [reply.choices[0].message.model_dump(exclude_none=True)]
                    history += [{"role": "user", "content": "+"}]
                    done.append(loop.time())
                return done

            long_task = asyncio.ensure_future(long_call())
            await asyncio.sleep(0.05)  # A's request is in flight first
            short = await short_calls()
            return short, await long_task

        short, long = asyncio.run(both())
        assert short[-1] < long, (short, long)
        assert [len(c["token_ids"]) for c in endpoint.episodes["b"].calls] == [1, 1]
    finally:
        endpoint.close()


def test_tool_calls_in_the_reply_and_back():
    """A turn with a hermes call becomes OpenAI tool_calls; the client's echo of that
    reply (as the client's model object) and a tool result extend the episode."""
    endpoint = AgentEndpoint(None, _Tok(), EpisodeConfig())
    try:
        text = 'ok<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
        message, finish = endpoint._reply(text, [1, 2], "stop", SamplingSpec(), [CALC])
        assert finish == "tool_calls" and message["content"] == "ok"
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "calc"
        assert json.loads(call["function"]["arguments"]) == {"expression": "2*3"}
        echoed = openai.types.chat.ChatCompletionMessage.model_validate(message).model_dump()
        from polyrl.rollout.openai_endpoint import _normal

        assert _normal(echoed) == _normal(message)
        # without tools offered the same text is plain content
        assert endpoint._reply(text, [1, 2], "stop", SamplingSpec(), None)[0] == {
            "role": "assistant",
            "content": text,
        }
    finally:
        endpoint.close()


class _Tok:
    """The least a tokenizer needs for ChatTokens (eos) in the reply test."""

    eos_token_id = None


# ---------------------------------------------------------------- agents' episodes


@register_agent("test/agent_three_calls")
async def three_calls(row, client):
    """Three calls, each on the previous reply (echoed as the client's object) + a hint."""
    messages = list(row["prompt"])
    for k in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=5, temperature=0.3
        )
        messages += [reply.choices[0].message, {"role": "user", "content": "+" * (k + 1)}]
    return 0.5


@register_agent("test/agent_fails")
async def fails(row, client):
    await client.chat.completions.create(model="policy", messages=list(row["prompt"]))
    if row["extra_info"].get("hang"):
        await asyncio.sleep(600)
    raise ValueError("the agent's own bug")


@register_agent("test/agent_rewrites")
async def rewrites(row, client):
    """The second call drops the first exchange: a new trajectory."""
    await client.chat.completions.create(model="policy", messages=list(row["prompt"]))
    second = [{"role": "user", "content": "try"}]
    await client.chat.completions.create(model="policy", messages=second, max_tokens=4)
    return 1.0


@register_agent("test/agent_too_many")
async def too_many(row, client):
    """Calls past max_turns (4): the fifth is refused, naming the limit."""
    messages = list(row["prompt"])
    try:
        for _ in range(5):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message, {"role": "user", "content": "+"}]
    except openai.BadRequestError as e:
        assert e.code == "max_turns", e
        return 0.25
    return 1.0


TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "run code",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}


@register_agent("test/agent_drops_its_tools")
async def drops_its_tools(row, client):
    """Offers a tool on the first call and none on the second, whose messages extend the
    first's: the tools are part of the rendered prompt, so this rewrites the history."""
    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
    messages += [reply.choices[0].message, {"role": "user", "content": "go on"}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return 1.0


def test_rewrite_reasons_name_the_message_or_the_tools():
    """What made a call rewrite: the first message that is not the previous call's (its
    index and role; a message left out counts as the history's), the tools added or
    removed by name, or the same tools defined otherwise."""
    from polyrl.rollout.openai_endpoint import _normal, rewrite_reasons

    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    history = [_normal(m) for m in [*first, {"role": "assistant", "content": "a"}]]
    extended = [*history, _normal({"role": "user", "content": "more"})]
    assert rewrite_reasons(history, extended, [TOOL], None) == ["tool_removed/python"]
    assert rewrite_reasons(history, extended, None, [TOOL]) == ["tool_added/python"]
    edited = [history[0], _normal({"role": "user", "content": "other"})]
    assert rewrite_reasons(history, edited, [TOOL], [TOOL]) == ["message/1/user"]
    assert rewrite_reasons(history, history[:2], None, None) == ["message/2/assistant"]
    other = [{**TOOL, "function": {**TOOL["function"], "description": "runs code"}}]
    assert rewrite_reasons(history, extended, [TOOL], other) == ["tools_changed"]


def test_an_agent_that_drops_its_tools_rewrites_and_the_health_check_names_them(pool, tokenizer):
    """Issue 46: an agent offering tools on one call and not the next trained only its last
    call, silently. The real endpoint records what differed and the step's health check
    names the tool (the messages themselves extend: no message is blamed)."""
    from polyrl.observe.health import HealthMonitor

    config = EpisodeConfig(max_turns=4, max_episode_tokens=160, env_workers=0, agent_timeout_s=30)
    runner = EpisodeRunner(pool, EnvPool(0, 10), tokenizer, config)
    try:
        batch = runner.generate(
            _rows(["test/agent_drops_its_tools"] * 2), SamplingSpec(n=2, max_tokens=4, seed=1)
        )
    finally:
        runner.shutdown()
    m = batch.info["episode_metrics"]
    assert list(batch["finish_reason"]) == ["done"] * 4
    assert m["episode/history_rewrite_share"] == 1.0
    assert m["episode/rewrite/tool_removed/python"] == 1.0
    assert not [k for k in m if k.startswith("episode/rewrite/message/")]
    # only the second call trains: its prompt is the fresh rendering, without the tools
    assert list(batch["num_turns"]) == [1] * 4
    said = []
    HealthMonitor(echo=said.append).check(m)
    assert len(said) == 1 and "WARNING history_rewritten: 100% of the step's episodes" in said[0]
    assert "tool 'python' offered on the previous call, not on the next" in said[0]


def _rows(sources, extras=None):
    n = len(sources)
    return Batch(
        {"prompt_index": np.arange(n)},
        {
            "prompt": [[{"role": "user", "content": "secret"}]] * n,
            "ground_truth": ["1"] * n,
            "data_source": list(sources),
            "extra_info": extras or [{}] * n,
        },
    )


def test_agent_episodes(pool, tokenizer):
    """Agents' episodes as the episode loop's rows: a three-call episode is one
    trajectory whose mask covers exactly the sampled ids (which the servers give again
    for the recorded prompt and seed), with the observations the template's; a raising
    and a hanging agent end only their episodes; a rewritten history keeps the last
    trajectory and is counted. (agent_timeout_s=15: the others' three calls must fit in
    it on a loaded 2-core machine, where one generate call has taken ~2 s.)"""
    config = EpisodeConfig(max_turns=4, max_episode_tokens=96, env_workers=0, agent_timeout_s=15)
    runner = EpisodeRunner(pool, EnvPool(0, 10), tokenizer, config)
    spec = SamplingSpec(n=2, max_tokens=6, seed=1)
    sources = ["test/agent_three_calls", "test/agent_fails", "test/agent_fails"]
    sources += ["test/agent_rewrites", "my/agent", "test/agent_too_many"]
    extras = [{}, {}, {"hang": True}, {}, {}, {}]
    # docs/agents.md's example agent plays too (it registers "my/agent")
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    section = text.split("## Agents written against the OpenAI client\n", 1)[1]
    (example,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    try:
        exec(compile(example, "docs/agents.md", "exec"), {})
        batch = runner.generate(_rows(sources, extras), spec)
    finally:
        runner.shutdown()
        AGENTS.pop("my/agent", None)
    finish = list(batch["finish_reason"])
    assert finish[:8] == ["done"] * 2 + ["agent_error"] * 2 + ["agent_timeout"] * 2 + ["done"] * 2
    assert "ValueError: the agent's own bug" in batch["turns"][2][-1]["error"]
    assert list(batch["scores"][:8]) == pytest.approx([0.5, 0.5, 0, 0, 0, 0, 1.0, 1.0])
    assert list(batch["num_turns"][:8]) == [3, 3, 1, 1, 1, 1, 1, 1]
    assert finish[8:10] == ["done"] * 2 and set(batch["num_turns"][8:10]) <= {1, 2, 3}
    # the refused fifth call: the episode ends at the limit, with the agent's reward
    assert finish[10:] == ["max_turns"] * 2 and list(batch["num_turns"][10:]) == [4, 4]
    assert list(batch["scores"][10:]) == pytest.approx([0.25, 0.25])
    m = batch.info["episode_metrics"]
    assert m["episode/history_rewrite_share"] == pytest.approx(2 / 12)
    assert m["episode/finish/agent_timeout"] == pytest.approx(2 / 12)

    mask = batch["response_mask"]
    for row in range(2):  # the three-call episodes
        prompt = list(batch["prompt_ids"][row])
        response = list(batch["responses"][row, : batch["response_lengths"][row]])
        expected_mask, pos = [], 0
        for k, turn in enumerate(batch["turns"][row]):
            sampled = response[pos : pos + turn["tokens"]]
            # the servers sample the same ids for the prompt so far and this call's seed
            (again,) = pool.generate_ids(
                [(row * config.max_turns + k, prompt + response[:pos], 6)],
                SamplingSpec(max_tokens=5, seed=1),
            )
            assert sampled == again["token_ids"].tolist()
            np.testing.assert_allclose(
                batch["rollout_log_probs"][row, pos : pos + len(sampled)],
                again["log_probs"],
                rtol=1e-5,
            )
            expected_mask += [1.0] * turn["tokens"] + [0.0] * turn.get("observation_tokens", 0)
            pos += turn["tokens"] + turn.get("observation_tokens", 0)
            if "observation" in turn:
                assert turn["observation"] == [{"role": "user", "content": "+" * (k + 1)}]
        assert pos == len(response)
        assert mask[row, : len(response)].tolist() == expected_mask
        assert mask[row, len(response) :].sum() == 0
        # the template applied afresh differs, if at all, only where the model sampled
        assert batch["drift"][row] is None or batch["drift"][row]["kind"] == "sampled"
    # the rewritten episodes train on the second call: its prompt is the new history's
    for row in (6, 7):
        assert list(batch["prompt_ids"][row]) == _template_ids(
            tokenizer, [{"role": "user", "content": "try"}]
        )
