"""The episode loop's token rules, limits and env failures, without Ray or vLLM.

The rollout servers are replaced by ``episode_policy.TextPolicy`` (random canonical text,
each turn stopped or cut); the envs run in the driver (``env_workers=0``).
tests/rollout/test_episodes.py runs the loop with Ray env workers and on real servers.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from episode_policy import ALPHABET, TextPolicy

from polyrl.batch import Batch
from polyrl.envs import Env, EpisodeConfig, StepResult, register_env
from polyrl.envs.workers import EnvPool
from polyrl.rollout.episodes import ChatTokens, EpisodeRunner, first_drift, placeholder
from polyrl.rollout.sampling import SamplingSpec

# Qwen's layout with a space after <|im_end|> where Qwen has a newline (the tiny
# vocabulary has no newline): the template closes an assistant turn with "<|im_end|> ",
# whose space the model never samples.
QWEN_LIKE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':' + m['content'] + '<|im_end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
)
# A generation prompt that ends in a space: the tiny tokenizer merges it with a turn that
# starts with punctuation (" +-" is one token), so a fresh rendering differs there.
SPACE_PROMPT = QWEN_LIKE.replace("assistant:' }}{% endif", "assistant: ' }}{% endif")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@register_env("test/chatter")
class Chatter(Env):
    """Random user/tool observations of random length; done with probability 0.2."""

    def reset(self, row):
        self.rng = random.Random(f"{row['ground_truth']}/{row['sample']}")
        return super().reset(row)

    def step(self, turn):
        if self.rng.random() < 0.2:
            return StepResult(reward=1.0, done=True)
        msgs = [
            {
                "role": self.rng.choice(["user", "tool"]),
                "content": "".join(
                    self.rng.choice(ALPHABET) for _ in range(self.rng.randint(0, 5))
                ),
            }
            for _ in range(self.rng.randint(1, 2))
        ]
        return StepResult(msgs, reward=0.25)


def _prompts(source: str, n: int) -> Batch:
    return Batch(
        {"prompt_index": np.arange(n)},
        {
            "prompt": [[{"role": "user", "content": f"copy {i:03d}"}] for i in range(n)],
            "ground_truth": [str(i) for i in range(n)],
            "data_source": [source] * n,
            "extra_info": [{"index": i} for i in range(n)],
        },
    )


def _runner(tokenizer, config: EpisodeConfig, policy=None):
    return EpisodeRunner(
        policy or TextPolicy(tokenizer),
        EnvPool(0, config.env_timeout_s),
        tokenizer,
        config,
    )


@pytest.mark.parametrize("template", ["tiny", "qwen_like"])
def test_trajectory_is_exactly_the_sampled_ids_plus_template_observations(tokenizer, template):
    """Many random episodes: the response is each turn's sampled ids as sampled, with the
    template's tokens between them; a fresh application of the template to the whole
    conversation gives the same ids (the policy samples canonical tokens), so no drift."""
    if template == "qwen_like":
        tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
        tokenizer.chat_template = QWEN_LIKE
    config = EpisodeConfig(max_turns=5, max_episode_tokens=200, env_workers=0)
    policy = TextPolicy(tokenizer, cut=0.3)
    runner = _runner(tokenizer, config, policy)
    batch = runner.generate(_prompts("test/chatter", 40), SamplingSpec(n=4, max_tokens=4))
    assert len(batch) == 160
    chat, eos = ChatTokens(tokenizer), tokenizer.eos_token_id
    cut_turns = 0
    for row in range(len(batch)):
        prompt = list(batch["prompt_ids"][row])
        n = int(batch["response_lengths"][row])
        response = list(batch["responses"][row, :n])
        mask = batch["response_mask"][row, :n]
        # every turn's request continued the episode's exact ids so far
        turns = policy.sampled.get(row * config.max_turns, [])
        pos = 0
        for t in range(int(batch["num_turns"][row])):
            asked, ids = policy.sampled[row * config.max_turns + t][0]
            assert asked == prompt + response[:pos]
            assert response[pos : pos + len(ids)] == ids and mask[pos : pos + len(ids)].all()
            np.testing.assert_array_equal(
                batch["rollout_log_probs"][row, pos : pos + len(ids)], -np.arange(1, len(ids) + 1)
            )
            assert (batch["rollout_token_versions"][row, pos : pos + len(ids)] == 7).all()
            pos += len(ids)
            while pos < n and mask[pos] == 0:  # the observation after the turn
                assert batch["rollout_log_probs"][row, pos] == 0
                pos += 1
            if ids[-1] != eos and pos > len(ids) and t + 1 < int(batch["num_turns"][row]):
                cut_turns += 1
        assert pos == n and turns is not None
        # the template applied afresh to the whole conversation: the same ids
        messages = list(batch["prompt"][row])
        for turn in batch["turns"][row]:
            messages.append({"role": "assistant", "content": turn["text"]})
            messages += turn.get("observation", [])
        fresh = chat.encode(chat.render(messages, None, False))
        assert fresh[: len(prompt) + n] == prompt + response
    assert cut_turns > 0  # cut turns were continued: their <|im_end|> came from the template
    m = batch.info["episode_metrics"]
    assert m["episode/drift_share"] == 0.0
    assert 0 < m["episode/observation_token_share"] < 1
    assert sum(m[f"episode/finish/{r}"] for r in ("done", "max_turns", "max_tokens")) == 1.0


def test_an_observation_renders_the_conversation_twice(tokenizer):
    """Each observation renders the conversation closed after the model's turn and with
    the new messages; the rendering it extends is the episode's last request's (its
    prompt's, or the last observation's), not rendered again; a row's samples render
    their prompt once; the drift check renders each episode once. The ids stay exact
    (test_trajectory_is_exactly_the_sampled_ids_plus_template_observations)."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    calls = []
    render = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *a, **k: calls.append(1) or render(*a, **k)
    config = EpisodeConfig(max_turns=5, max_episode_tokens=200, env_workers=0)
    runner = _runner(tokenizer, config, TextPolicy(tokenizer, cut=0.3))
    batch = runner.generate(_prompts("test/chatter", 10), SamplingSpec(n=4, max_tokens=4))
    observations = sum("observation" in t for turns in batch["turns"] for t in turns)
    assert observations > 10
    assert len(calls) == 10 + 2 * observations + len(batch)


def test_the_warm_up_placeholder_has_a_real_batchs_columns(tokenizer):
    """The multi-turn warm-up's placeholder (RunConfig.warm_up) carries every column of
    the batch the episodes give for the same prompts, in the same dtypes and shapes
    (an env that keeps the row's prompt: the same prompt width), with responses of
    different lengths (rows with and without padding), so step 1 compiles nothing
    (end to end: tests/trainer/test_trainer.py, the multi-turn warm-up cases)."""
    config = EpisodeConfig(max_turns=3, max_episode_tokens=40, env_workers=0)
    spec = SamplingSpec(n=4, max_tokens=4)
    prompts = _prompts("test/chatter", 6)
    real = _runner(tokenizer, config).generate(prompts, spec)
    fake = placeholder(prompts, spec, config, tokenizer)
    assert sorted(fake.tensors) == sorted(real.tensors)
    for name in real.tensors:
        assert (fake[name].dtype, fake[name].shape) == (real[name].dtype, real[name].shape), name
    assert sorted(fake.meta) == sorted(real.meta)
    assert set(fake["response_lengths"]) == {1, spec.max_tokens}


def test_cut_turn_gets_the_end_of_turn_from_the_template(tokenizer):
    """A turn cut at max_tokens has no <|im_end|>: the observation starts with it (masked),
    and for a turn that ended itself, the observation starts at the next message."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = QWEN_LIKE
    chat, eos = ChatTokens(tokenizer), tokenizer.eos_token_id
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    msgs = [{"role": "user", "content": "copy 1"}, {"role": "assistant", "content": "12"}]
    new = [{"role": "user", "content": "+"}]
    ids = chat.encode("12")
    next_msg = chat.encode("<|im_start|>user:+<|im_end|> <|im_start|>assistant:")
    assert chat.observation(msgs, new, None, ids + [eos])[0] == space + next_msg
    assert chat.observation(msgs, new, None, ids)[0] == [eos] + space + next_msg


def test_first_drift_names_turn_and_kind():
    segments = [("sampled", 0, 3, 5), ("observation", 0, 5, 8), ("sampled", 1, 8, 9)]
    ids = [1, 2, 3, 10, 11, 20, 21, 22, 30]
    assert first_drift(ids, ids + [99], segments) is None  # the template closes the last turn
    assert first_drift(ids, [1, 2, 3, 10, 12, 20, 21, 22, 30], segments) == {
        "position": 4,
        "turn": 0,
        "kind": "sampled",
    }
    drift = first_drift(ids, [1, 2, 3, 10, 11, 20, 5, 22, 30], segments)
    assert drift == {"position": 6, "turn": 0, "kind": "observation"}
    assert first_drift(ids, ids[:7], segments)["position"] == 7


def test_non_canonical_sampled_tokens_are_kept_and_reported(tokenizer):
    """The model may sample "u s e r" as four tokens where the tokenizer has one for
    "user": the episode keeps the sampled ids and the drift is reported as sampled."""

    class Spelled(TextPolicy):
        def generate_ids(self, requests, spec):
            out = super().generate_ids(requests, spec)
            for r in out:
                ids = [tokenizer.convert_tokens_to_ids(c) for c in "user"] + [
                    tokenizer.eos_token_id
                ]
                r.update(token_ids=np.asarray(ids, np.int32), log_probs=np.zeros(5, np.float32))
                r.update(text="user", finish_reason="stop")
            return out

    assert len(tokenizer("user", add_special_tokens=False)["input_ids"]) == 1
    config = EpisodeConfig(max_turns=2, max_episode_tokens=100, env_workers=0)
    batch = _runner(tokenizer, config, Spelled(tokenizer)).generate(
        _prompts("test/chatter", 4), SamplingSpec(n=1, max_tokens=8)
    )
    m = batch.info["episode_metrics"]
    assert m["episode/drift_share"] == 1.0 and m["episode/template_drift_share"] == 0.0
    assert list(batch["responses"][0, :4]) == [tokenizer.convert_tokens_to_ids(c) for c in "user"]


def test_template_drift_at_a_token_boundary_is_reported(tokenizer, caplog):
    """A generation prompt ending in a space, then a turn "+-": the episode keeps the
    prompt's space token and the sampled "+-", a fresh rendering merges them; the
    drift is reported at the observation's last token, with a warning."""

    class Plus(TextPolicy):
        def generate_ids(self, requests, spec):
            out = super().generate_ids(requests, spec)
            plus = tokenizer("+", add_special_tokens=False)["input_ids"]
            for r in out:
                r.update(token_ids=np.asarray(plus + [tokenizer.eos_token_id], np.int32))
                r.update(log_probs=np.zeros(len(plus) + 1, np.float32), text="+-")
                r.update(finish_reason="stop")
            return out

    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = SPACE_PROMPT
    assert len(tokenizer(" +-", add_special_tokens=False)["input_ids"]) == 1
    config = EpisodeConfig(max_turns=2, max_episode_tokens=100, env_workers=0)
    with caplog.at_level("WARNING"):
        batch = _runner(tokenizer, config, Plus(tokenizer)).generate(
            _prompts("test/endless", 2), SamplingSpec(n=1, max_tokens=4)
        )
    assert batch.info["episode_metrics"]["episode/template_drift_share"] == 1.0
    assert "gives other tokens than the episode's from position" in caplog.text


def test_an_episode_is_closed_out_while_the_others_play(tokenizer):
    """An episode's response text and drift check are done as it ends, while the other
    episodes still play (at the batch's end they held up the generate phase): episode 1's
    second turn is answered only once episode 0, ended, has both (every episode drifts:
    SPACE_PROMPT's last space before a sampled "+")."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = SPACE_PROMPT
    config = EpisodeConfig(max_turns=2, max_episode_tokens=100, env_workers=0)
    plus = tokenizer("+", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    episodes = []

    class Waits(TextPolicy):
        async def generate_on(self, server, requests, spec):
            ((index, _, _),) = requests
            if index == 1 * config.max_turns + 1:  # episode 1's second turn
                for _ in range(1000):
                    if episodes[0].text is not None:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("episode 0 was not closed out while episode 1 played")
            (r,) = self.generate_ids(requests, spec)
            n = len(plus)
            r.update(token_ids=np.asarray(plus, np.int32), log_probs=np.zeros(n, np.float32))
            return [r | {"text": "+", "finish_reason": "stop"}]

    runner = _runner(tokenizer, config, Waits(tokenizer))
    spec = SamplingSpec(n=1, max_tokens=4)
    episodes += runner.start(_prompts("test/endless", 2), spec)
    asyncio.run(runner._play(episodes, spec))
    for e in episodes:  # before finish(): closed out as they ended
        assert e.text == tokenizer.decode(e.ids, skip_special_tokens=False)
        assert e.drift is not None  # the prompt's last space and "+": one token afresh


def test_a_rows_version_is_its_oldest_sampled_tokens(tokenizer):
    """Turn t sampled by weight version 10 - t: each sampled token carries its turn's
    version, observation tokens -1, and the row's version is its last turn's (the
    oldest); an episode whose prompt does not fit samples nothing and gets the pool's."""

    class Aging(TextPolicy):
        def generate_ids(self, requests, spec):
            out = super().generate_ids(requests, spec)
            for (index, _, _), r in zip(requests, out):
                r["version"] = 10 - index % config.max_turns
            return out

    config = EpisodeConfig(max_turns=3, max_episode_tokens=60, env_workers=0)
    prompts = _prompts("test/endless", 3)
    long = [{"role": "user", "content": "copy " + "1" * 80}]
    prompts = prompts.with_columns(meta={"prompt": [*prompts["prompt"][:2], long]})
    batch = _runner(tokenizer, config, Aging(tokenizer)).generate(prompts, SamplingSpec(n=1))
    for row in range(2):
        n, turns = int(batch["response_lengths"][row]), int(batch["num_turns"][row])
        versions, mask = batch["rollout_token_versions"][row, :n], batch["response_mask"][row, :n]
        assert turns >= 2 and set(versions[mask == 0]) == {-1}
        assert set(versions[mask > 0]) == {10 - t for t in range(turns)}
        assert batch["rollout_weight_version"][row] == 10 - (turns - 1)
    assert batch["response_lengths"][2] == 0 and batch["finish_reason"][2] == "max_tokens"
    assert batch["rollout_weight_version"][2] == TextPolicy.version


# ------------------------------------------------------------------ limits and failures


@register_env("test/endless")
class Endless(Env):
    """Never done; reports 3 tool calls (one failing) per step; a long observation on
    the turn the row's extra_info names."""

    def reset(self, row):
        self.long_at = row["extra_info"].get("long_at", -1)
        return super().reset(row)

    def step(self, turn):
        text = "copy " * (30 if turn.index == self.long_at else 1)
        info = {"tool_calls": 3.0, "tool_errors": 1.0, "tool_seconds": 0.3}
        return StepResult([{"role": "user", "content": text}], reward=0.1, info=info)


def _one(source: str, extra: dict, config: EpisodeConfig, tokenizer) -> Batch:
    prompts = _prompts(source, 1).with_columns(meta={"extra_info": [extra]})
    return _runner(tokenizer, config).generate(prompts, SamplingSpec(n=2, max_tokens=3))


@pytest.mark.parametrize(
    ("extra", "limits", "reason", "turns"),
    [
        ({}, {"max_turns": 3}, "max_turns", 3),
        ({}, {"max_turns": 9, "max_tool_calls": 7}, "max_tool_calls", 3),
        ({"long_at": 1}, {"max_turns": 9, "max_episode_tokens": 90}, "max_tokens", 2),
    ],
)
def test_limits_end_episodes_with_their_reason(tokenizer, extra, limits, reason, turns):
    config = EpisodeConfig(env_workers=0, **{"max_tool_calls": 100, **limits})
    batch = _one("test/endless", extra, config, tokenizer)
    assert list(batch["finish_reason"]) == [reason, reason]
    assert list(batch["num_turns"]) == [turns, turns]
    # each turn's reward sits on its last sampled token; the score sums them
    np.testing.assert_allclose(batch["scores"], 0.1 * turns, rtol=1e-6)
    assert (batch["token_rewards"][batch["response_mask"] == 0] == 0).all()
    assert (batch["prompt_lengths"] + batch["response_lengths"] <= config.max_episode_tokens).all()
    m = batch.info["episode_metrics"]
    assert m[f"episode/finish/{reason}"] == 1.0
    assert m["episode/tool_calls_mean"] == 3.0 * turns
    assert m["episode/tool_error_share"] == pytest.approx(1 / 3)
    assert m["episode/tool_latency_s"] == pytest.approx(0.1)


def test_a_batch_with_no_sampled_token_names_why(tokenizer):
    """Every prompt longer than max_episode_tokens: no episode gets a turn, and the run
    stops naming the limit (not the trainer's "response_mask sums to 0")."""
    config = EpisodeConfig(max_turns=2, max_episode_tokens=8, env_workers=0)
    with pytest.raises(RuntimeError, match=r"ended \{'max_tokens': 2\} before the first turn"):
        _one("test/endless", {}, config, tokenizer)
    with pytest.raises(RuntimeError, match=r"EpisodeConfig.max_episode_tokens=8: raise it"):
        _one("test/endless", {}, config, tokenizer)


@register_env("test/faulty")
class Faulty(Env):
    """Fails at turn 1 in the way extra_info["fault"] names; plays on otherwise."""

    def reset(self, row):
        self.fault = row["extra_info"]["fault"]
        if self.fault == "reset":
            raise RuntimeError("no board")
        return super().reset(row)

    async def step(self, turn):
        if turn.index == 1:
            if self.fault == "raise":
                raise ValueError("bad move")
            if self.fault == "hang":
                await asyncio.sleep(30)
            if self.fault == "malformed":
                return {"observation": "not a StepResult"}
        if turn.index == 2:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "+"}])


def test_env_failures_end_only_their_episode(tokenizer):
    faults = ["none", "reset", "raise", "hang", "malformed", "none"]
    prompts = _prompts("test/faulty", len(faults)).with_columns(
        meta={"extra_info": [{"fault": f} for f in faults]}
    )
    config = EpisodeConfig(max_turns=4, env_workers=0, env_timeout_s=0.5)
    batch = _runner(tokenizer, config).generate(prompts, SamplingSpec(n=1, max_tokens=3))
    assert list(batch["finish_reason"]) == [
        "done",
        "env_error",
        "env_error",
        "env_timeout",
        "env_error",
        "done",
    ]
    assert list(batch["num_turns"]) == [3, 0, 2, 2, 2, 3]
    assert list(batch["scores"]) == [1.0, 0, 0, 0, 0, 1.0]
    errors = [t[-1].get("error", "") for t in batch["turns"][2:5]]
    assert "ValueError: bad move" in errors[0]
    assert "ran past 0.5 s" in errors[1]
    assert "not polyrl.envs.StepResult" in errors[2]
    assert batch["response_mask"][1].sum() == 0  # no turn: nothing to train on


def test_encode_many_gives_each_texts_ids(tiny_model_dir):
    """The drift check tokenizes a batch's renderings in one call of the Rust tokenizer:
    the same ids as the tokenizer called on each text (special tokens, digits, text the
    merges split, an empty one)."""
    from transformers import AutoTokenizer

    texts = [
        "<|im_start|>user:copy 123<|im_end|><|im_start|>assistant:",
        "copy copy 0=0 + 9*9 <|im_end|>\n",
        "",
        "".join(random.Random(0).choice(ALPHABET) for _ in range(300)),
    ]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert ChatTokens(tok).encode_many(texts) == expected
