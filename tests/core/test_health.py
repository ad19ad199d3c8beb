"""Health warnings on hand-made step metrics; rollout dumps and the timeline file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyrl.batch import Batch
from polyrl.loop.dumps import RolloutDumps
from polyrl.observe.health import HealthMonitor, explained_variance, response_stats
from polyrl.observe.timeline import Timeline

HEALTHY = {"actor/kl_loss": 0.1, "actor/entropy": 3.0, "time/generate": 0.5}


def _run(steps: list[dict], scores: list | None = None) -> tuple[list[str], list[dict]]:
    said: list[str] = []
    mon = HealthMonitor(echo=said.append)
    out = [mon.check(m, None if scores is None else scores[i]) for i, m in enumerate(steps)]
    return said, out


def test_healthy_steps_are_silent():
    said, out = _run([HEALTHY] * 10, [np.array([0.0, 0.5, 1.0])] * 10)
    assert said == []
    assert out[-1] and not any(out[-1].values())


def test_identical_rewards_fire_after_patience_and_once():
    said, out = _run([HEALTHY] * 5, [np.zeros(8)] * 5)
    assert [o["health/rewards_identical"] for o in out] == [0, 0, 1, 1, 1]
    assert len(said) == 1 and "same reward (0.0) for 3 steps" in said[0]


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("response/empty_fraction", "responses_empty"),
        ("response/cut_short_fraction", "responses_cut"),
        ("response/stop_at_once_fraction", "responses_stop_at_once"),
    ],
)
def test_most_responses_broken(key, name):
    said, out = _run([HEALTHY | {key: 0.4}, HEALTHY | {key: 0.75}])
    assert out[0][f"health/{name}"] == 0 and out[1][f"health/{name}"] == 1
    assert said[0].startswith(f"[health] WARNING {name}: 75% of the responses")


def test_dropped_prompts_kl_and_entropy():
    said, out = _run(
        [
            HEALTHY,
            HEALTHY | {"rollout/dropped_prompt_fraction": 0.25},
            HEALTHY | {"actor/kl_loss": float("nan")},
            HEALTHY | {"actor/entropy": 4.6},  # > 1.5 x the first step's 3.0
        ]
    )
    assert [sum(o.values()) for o in out] == [0, 1, 1, 1]
    assert "25% of the step's prompts were dropped" in said[0]
    assert "KL to the reference is nan" in said[1]
    assert "entropy is 4.6" in said[2]


EPISODES = HEALTHY | {
    "episode/turns_mean": 2.0,
    "episode/tools_offered": 1.0,
    "episode/tool_calls_mean": 1.5,
    "episode/tool_error_share": 0.2,
    "episode/finish/max_turns": 0.1,
}


@pytest.mark.parametrize(
    ("bad", "name", "said_part"),
    [
        ({"episode/tool_calls_mean": 0.0}, "tools_never_called", "no episode called one for 3"),
        ({"episode/tool_error_share": 0.8}, "tool_calls_failing", "80% of the tool calls failed"),
        ({"episode/finish/max_turns": 0.9}, "episodes_cut_at_max_turns", "90% of the episodes"),
    ],
)
def test_episode_warnings_fire_after_patience(bad, name, said_part):
    said, out = _run([EPISODES, EPISODES | bad, EPISODES | bad, EPISODES | bad])
    assert [o[f"health/{name}"] for o in out] == [0, 0, 0, 1]
    assert (
        len(said) == 1 and said[0].startswith(f"[health] WARNING {name}") and said_part in said[0]
    )


def test_most_episodes_rewriting_fires_at_once_and_says_what_differed():
    """An agent that drops its tools on the second call rewrites every episode: only its
    last call trains. One step is enough, and the warning names the tool; a minority of
    rewrites stays quiet."""
    few = EPISODES | {"episode/history_rewrite_share": 0.25, "episode/rewrite/message/1/user": 0.25}
    rewrote = EPISODES | {
        "episode/history_rewrite_share": 1.0,
        "episode/rewrite/tool_removed/python": 1.0,
        "episode/rewrite/message/2/tool": 0.25,
    }
    said, out = _run([few, rewrote, rewrote])
    assert [o["health/history_rewritten"] for o in out] == [0, 1, 1]
    assert len(said) == 1 and said[0].startswith("[health] WARNING history_rewritten: 100% of")
    assert (
        "tool 'python' offered on the previous call, not on the next (100% of the episodes); "
        "message 2 (tool) differed from the previous call's (25% of the episodes)" in said[0]
    )


def test_tools_not_offered_is_not_a_warning():
    quiet = EPISODES | {"episode/tools_offered": 0.0, "episode/tool_calls_mean": 0.0}
    said, _ = _run([quiet] * 5)
    assert said == []


def test_critic_blow_up():
    base = HEALTHY | {"critic/loss": 0.5, "critic/explained_variance": 0.3}
    said, out = _run(
        [
            base,
            base,
            base | {"critic/loss": 0.7},
            base | {"critic/loss": 80.0},  # 160 x the median 0.5 of the earlier losses
            base | {"critic/explained_variance": -5.0},
            base | {"critic/explained_variance": -5.0},
            base | {"critic/explained_variance": -5.0},
            base | {"critic/loss": float("inf")},
        ]
    )
    assert [o["health/critic_loss_growing"] for o in out[:4]] == [0, 0, 0, 1]
    assert [o["health/value_ev_collapsed"] for o in out[4:7]] == [0, 0, 1]
    assert out[7]["health/critic_non_finite"] == 1
    # at once: 100 x the loss of a critic predicting 0 (0.5 * mean(returns^2) = 0.01)
    said_now, out = _run([base | {"critic/loss": 1.5, "critic/zero_value_loss": 0.01}])
    assert out[0]["health/critic_loss_growing"] == 1 and "predicts 0" in said_now[0]
    assert [s.split(":")[0] for s in said] == [
        "[health] WARNING critic_loss_growing",
        "[health] WARNING value_ev_collapsed",
        "[health] WARNING critic_non_finite",
    ]


def test_slow_phase_against_its_median():
    steps = [HEALTHY | {"time/generate": 0.5}] * 5 + [HEALTHY | {"time/generate": 3.0}]
    said, out = _run(steps)
    assert [o["health/phase_slow"] for o in out] == [0] * 5 + [1]
    assert "phase generate took 3.00 s, which is 6x its median" in said[0]


def test_explained_variance_by_hand():
    returns = np.array([[1.0, 3.0, 9.0]])
    mask = np.array([[1, 1, 0]])  # the 9 is padding
    assert explained_variance(returns, returns, mask) == 1.0
    # residuals (1-2, 3-2) = (-1, 1): variance 1 = the returns' variance -> 0
    assert explained_variance(np.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return list(text)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _batch() -> Batch:
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], np.float32)
    return Batch(
        {
            "response_mask": mask,
            "response_lengths": mask.sum(-1).astype(np.int32),
            "prompt_lengths": np.array([2, 2, 2, 2], np.int32),
            "scores": np.array([1.0, 0.0, 0.0, 0.5], np.float32),
            "advantages": mask * np.array([[0.5], [-1.0], [0.0], [2.0]], np.float32),
            "prompt_index": np.array([7, 7, 3, 3], np.int64),  # n = 2 samples of data rows 7, 3
        },
        {
            "finish_reason": ["stop", "stop", "length", "length"],
            "ground_truth": ["ab", "ab", "abcd", "ab"],
            "data_source": ["s"] * 4,
            "response_text": ["ab", "", "", "abc"],
            "prompt_ids": [[104, 105]] * 4,
        },
        {"n": 2, "dropped": [5]},
    )


def test_response_stats_by_hand():
    stats = response_stats(_batch(), CharTokenizer())
    assert stats == {
        "response/empty_fraction": 0.25,
        "response/cut_fraction": 0.5,
        "response/cut_short_fraction": 0.25,  # row 2: cut at 0 tokens, truth has 4
        "response/stop_at_once_fraction": 0.25,  # row 1: one token, "stop"
        "rollout/dropped_prompt_fraction": 1 / 3,  # 2 prompts kept (4 rows / n=2) + 1
    }


def test_dumps_every_k_steps_and_glance(tmp_path):
    said: list[str] = []
    dumps = RolloutDumps(tmp_path, CharTokenizer(), every=2, samples=2, echo=said.append)
    for step in range(1, 5):  # steps count from 1: step 1, then every 2
        dumps.write(step, _batch())
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").open()]
    assert [(r["step"], r["index"]) for r in rows] == [
        (1, 0),
        (1, 3),
        (2, 0),
        (2, 3),
        (4, 0),
        (4, 3),
    ]
    assert rows[1] | {"step": 0} == {
        "step": 0,
        "index": 3,
        "prompt_index": 3,
        "data_source": "s",
        "prompt": "hi",
        "response": "abc",
        "ground_truth": "ab",
        "reward": 0.5,
        "advantage": 2.0,
        "prompt_length": 2,
        "response_length": 3,
        "finish_reason": "length",
    }
    # the first dump in full, later ones as two short lines each
    assert len(said) == 7 and said[0].startswith("[rollouts] step 1: 2 samples")
    assert "reward 0.5 adv +2.00 len 3 (length) | 'hi' -> 'abc'" in said[2]
    assert said[6] == "  [sample] step 4: 'hi' -> 'abc' (want 'ab', reward 0.50)"
    assert dumps.text == "\n".join(said[5:])
    dumps.resume(2)  # a run resumed from step_2 takes step 4 again: its dump goes first
    steps = [json.loads(line)["step"] for line in (tmp_path / "rollouts.jsonl").open()]
    assert steps == [1, 1, 2, 2]


def test_timeline_is_a_chrome_trace(tmp_path):
    tl = Timeline(tmp_path / "timeline.json")
    tl.add("generate", tl.origin + 1.0, 0.25, step=0)
    tl.add("update_actor", tl.origin + 1.5, 0.5, step=0)
    tl.flush()
    tl.add("reward", tl.origin + 1.25, 0.125, step=0)
    tl.flush()  # appended: the file is a JSON array the viewers read before it is closed
    assert json.loads((tmp_path / "timeline.json").read_text() + "]")[-1]["name"] == "reward"
    tl.close()
    events = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert [(names[e["tid"]], e["name"], e["ts"], e["dur"]) for e in spans] == [
        ("rollout", "generate", 1_000_000, 250_000),
        ("actor", "update_actor", 1_500_000, 500_000),
        ("reward", "reward", 1_250_000, 125_000),
    ]
