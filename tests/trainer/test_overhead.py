"""Framework overhead: which engines take turns per placement (polyrl.cluster.residency), the
overhead as the step time outside the union of the compute phases, and forwards of
resident roles run at once with the same numbers as one after another."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from polyrl.algos import get_algorithm
from polyrl.cluster.placement import plan_shares
from polyrl.cluster.residency import fits_resident, param_count, turn_roles
from polyrl.cluster.roles import build_roles
from polyrl.configure.launch import parse_config
from polyrl.loop.metrics import PhaseTimer, covered, phase_summary

GPU_GRPO = "gin/experiments/gpu_grpo_0p5b.gin"
GiB = 2**30


def test_covered_is_the_union_of_intervals():
    # [0,2] and [1,3] overlap into [0,3]; [5,6] is apart; [5.5,5.7] lies inside it.
    assert covered([(1, 3), (0, 2), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert covered([]) == 0.0


def test_overhead_counts_overlapping_phases_once():
    timer = PhaseTimer(echo=False)
    timer.start_step(1)
    t0 = timer.t0
    timer.record("reference", t0 + 0.0, 0.02)  # both forwards ran at once: [0, 0.02]
    timer.record("old_log_probs", t0 + 0.0, 0.03)  # and [0, 0.03]
    timer.record("reload", t0 + 0.03, 0.01)  # not compute
    timer.record("update_actor", t0 + 0.04, 0.02)
    while time.perf_counter() < t0 + 0.1:
        pass
    m = timer.metrics(("reference", "old_log_probs", "update_actor"))
    busy = 0.03 + 0.02  # the union, not 0.02 + 0.03 + 0.02
    assert m["time/overhead"] == pytest.approx(m["time/step"] - busy, abs=1e-9)
    assert m["time/reference"] == 0.02 and m["time/reload"] == 0.01
    rows = [m | {"time/step": 1.0, "time/overhead": 0.25}]
    assert "framework overhead (step time outside reference/update_actor): 0.25 s (25.0%)" in (
        phase_summary(rows, ("reference", "update_actor"))
    )


def _qwen_config(path: Path, **shape) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", **shape}))
    return path


QWEN_0P5B = dict(  # Qwen2.5-0.5B's shape: 494,032,768 parameters (its model card)
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
QWEN_7B = dict(  # Qwen2.5-7B's shape: 7,615,616,512 parameters (its model card)
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)


def test_param_count_matches_transformers(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(QWEN_0P5B, hidden_size=64, num_attention_heads=4, vocab_size=300)
    for tie in (True, False):
        cfg = Qwen2Config(**shape | {"tie_word_embeddings": tie, "intermediate_size": 96})
        model = Qwen2ForCausalLM(cfg)
        model.save_pretrained(tmp_path / str(tie))
        want = sum(p.numel() for p in model.parameters())
        assert param_count(tmp_path / str(tie)) == want
    assert param_count(_qwen_config(tmp_path / "0p5b", **QWEN_0P5B)) == 494_032_768
    assert param_count(_qwen_config(tmp_path / "7b", **QWEN_7B)) == 7_615_616_512


def test_fits_resident_keeps_headroom():
    gpus = {"g0": (60 * GiB, 100 * GiB)}  # 40 GiB free
    assert fits_resident(gpus, {"g0": 19 * GiB}, headroom=0.2)  # 19 + 20 <= 40
    assert not fits_resident(gpus, {"g0": 21 * GiB}, headroom=0.2)  # 21 + 20 > 40
    assert not fits_resident({}, {})  # nothing measured: not known to fit


def _plan(tmp_path: Path, gin: str, model: dict, *params: str):
    model_dir = _qwen_config(tmp_path / "model", **model)
    cfg, _ = parse_config(
        [gin],
        [f"polyrl.RunConfig.model_path = '{model_dir}'", "polyrl.RunConfig.run_dir = '/tmp/x'"]
        + list(params),
    )
    roles = build_roles(cfg, get_algorithm(cfg.algorithm))  # no preflight: no GPU here
    return cfg, roles, plan_shares(cfg.pools, roles)


def _probe(used_gib: float, total_gib: float, calls: list[str]):
    def probe(role):
        calls.append(role)
        return [{"gpu": "node:0", "used": int(used_gib * GiB), "total": int(total_gib * GiB)}]

    return probe


def test_shipped_experiment_keeps_engines_resident_on_an_h200(tmp_path):
    """gin/experiments/gpu_grpo_0p5b.gin on one H200 (140 GiB): vLLM's 0.35 share plus
    both 0.5B engines leave far more than the actor's training state (3 x 0.99 GB) and
    20% headroom, so nothing moves between phases."""
    cfg, roles, shares = _plan(tmp_path, GPU_GRPO, QWEN_0P5B)
    calls: list[str] = []
    assert turn_roles(cfg, roles, shares, _probe(0.35 * 140 + 6, 140, calls)) == (
        frozenset(),
        False,
    )
    assert sorted(calls) == ["actor", "reference"]


def test_a_model_too_big_to_sit_side_by_side_takes_turns(tmp_path):
    # 7B bf16 on an 80 GiB GPU: vLLM 28 + actor 14.2 + reference 14.2 = 56 GiB used;
    # 24 GiB free < 3 x 14.2 GiB of gradients and Adam state + 16 GiB headroom.
    cfg, roles, shares = _plan(tmp_path, GPU_GRPO, QWEN_7B)
    probe = _probe(56, 80, [])
    assert turn_roles(cfg, roles, shares, probe) == (frozenset({"actor", "reference"}), False)
    # The servers sleep only when sleep mode is on.
    cfg, roles, shares = _plan(
        tmp_path, GPU_GRPO, QWEN_7B, "polyrl.RolloutConfig.enable_sleep_mode = True"
    )
    assert turn_roles(cfg, roles, shares, probe) == (frozenset({"actor", "reference"}), True)
    # No nvidia-smi reading: not known to fit, so turns stay on.
    cfg, roles, shares = _plan(tmp_path, GPU_GRPO, QWEN_0P5B)
    assert turn_roles(cfg, roles, shares, lambda role: [None])[0] == {"actor", "reference"}


LORA_ALL = (
    "polyrl.RunConfig.lora = @polyrl.LoraConfig()",
    "polyrl.LoraConfig.rank = 16",
    'polyrl.LoraConfig.target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", '
    '"gate_proj", "up_proj", "down_proj")',
)


def test_a_lora_actor_needs_room_for_its_adapters_only(tmp_path):
    """A 7B actor with rank-16 LoRA on every projection (40.4M trained parameters, as
    train_step.py counted them: docs/performance.md "LoRA vs full fine-tuning") keeps no
    gradients or Adam moments for its frozen base: vLLM 33 GiB + the actor's 14.2 GiB of
    weights = 48 GiB used of 80 leaves 32 GiB, room for the adapters' state and 16 GiB of
    headroom, so it stays resident; the same actor training every weight needs 3 x 14.2
    GiB more and takes turns."""
    from polyrl.cluster.residency import lora_param_count

    cfg, roles, shares = _plan(tmp_path, GPU_GRPO, QWEN_7B, *LORA_ALL)
    # per layer 16 x (in + out): q, o 3584 + 3584; k, v 3584 + 512; gate, up, down 3584 + 18944
    per_layer = 16 * (2 * 7168 + 2 * 4096 + 3 * 22528)
    assert lora_param_count(cfg.model_path, cfg.lora) == 28 * per_layer == 40_370_176
    calls: list[str] = []
    assert turn_roles(cfg, roles, shares, _probe(48, 80, calls)) == (frozenset(), False)
    assert calls == ["actor"]  # the reference is the actor's base: no role of its own
    cfg, roles, shares = _plan(tmp_path, GPU_GRPO, QWEN_7B)
    assert turn_roles(cfg, roles, shares, _probe(48, 80, []))[0] == {"actor", "reference"}


def test_disaggregated_rollout_never_sleeps_and_lone_roles_never_move(tmp_path):
    cfg, roles, shares = _plan(
        tmp_path,
        "gin/experiments/gpu_grpo_0p5b_async.gin",
        QWEN_0P5B,
        "polyrl.RunConfig.offload_colocated = True",
        "polyrl.RolloutConfig.enable_sleep_mode = True",
        "polyrl.RunConfig.async_rollout = False",
        'polyrl.RunConfig.pools = {"train": {"CPU": 6, "GPU": 1}, "ref": {"CPU": 2, "GPU": 1},'
        ' "gen": {"CPU": 6, "GPU": 1}}',
        'actor/polyrl.RoleConfig.pool = "train"',
        'reference/polyrl.RoleConfig.pool = "ref"',
        'polyrl.RolloutConfig.pool = "gen"',
    )
    calls: list[str] = []
    # Forced on, yet nothing shares a GPU: no role takes turns, the rollout never sleeps,
    # and nothing is measured.
    assert turn_roles(cfg, roles, shares, _probe(1, 80, calls)) == (frozenset(), False)
    assert calls == []


def test_cpu_pools_and_the_off_switch_take_no_turns(tmp_path):
    cfg, roles, shares = _plan(tmp_path, "gin/experiments/tiny_grpo.gin", QWEN_0P5B)
    calls: list[str] = []
    assert turn_roles(cfg, roles, shares, _probe(1, 80, calls)) == (frozenset(), False)
    cfg, roles, shares = _plan(
        tmp_path, GPU_GRPO, QWEN_7B, "polyrl.RunConfig.offload_colocated = False"
    )
    assert turn_roles(cfg, roles, shares, _probe(79, 80, calls)) == (frozenset(), False)
    assert calls == []


@pytest.mark.slow
def test_ppo_forwards_at_once_equal_one_after_another(ray_session, tmp_path):
    """PPO has three forwards (reference, old log-probs, critic values): run at once (no
    turns, the CPU default) or one after another (turns forced on), every number is the
    same."""
    from polyrl.configure.launch import train
    from polyrl.loop.metrics import read_jsonl

    runs = {}
    for name, extra in (
        ("together", []),
        ("serial", ["polyrl.RunConfig.offload_colocated = True"]),
    ):
        run = tmp_path / name
        params = [f"polyrl.RunConfig.run_dir = '{run}'", "polyrl.RunConfig.total_steps = 3"]
        train(["gin/experiments/tiny_ppo.gin"], params + extra)
        runs[name] = read_jsonl(run / "metrics.jsonl")
    keys = ("critic/loss", "critic/explained_variance", "actor/loss", "kl_in_reward/kl")
    for a, b in zip(runs["together"], runs["serial"]):
        assert [a[k] for k in keys] == [b[k] for k in keys], a["step"]
    assert all("time/reload" in r for r in runs["serial"])
    assert not any("time/reload" in r for r in runs["together"])


def test_the_shadow_check_is_a_phase_of_its_own_not_overhead():
    """Issue 47: the three-way check (RunConfig.shadow_every) was counted as framework
    overhead (42% of a short run). It is a phase of its own: in the table, on a line of its
    own, outside the overhead, both as logged (time/overhead) and for rows without it."""
    from polyrl.loop.trainer import COMPUTE_PHASES

    timer = PhaseTimer(echo=False)
    timer.start_step(1)
    t0 = timer.t0
    timer.record("generate", t0, 0.02)
    timer.record("shadow", t0 + 0.02, 0.05)
    timer.record("update_actor", t0 + 0.07, 0.02)
    while time.perf_counter() < t0 + 0.1:
        pass
    m = timer.metrics(COMPUTE_PHASES)
    # the step time outside generate, shadow and update_actor: 0.1 s and more - 0.09 s
    assert m["time/overhead"] == pytest.approx(m["time/step"] - 0.09, abs=1e-9)
    assert m["time/shadow"] == 0.05
    # two steps of 1 s, the check in one of them: 0.2 + 0.1 + 0.3 = 0.6 s of phases
    step = {"time/generate": 0.2, "time/update_actor": 0.1, "time/step": 1.0}
    rows = [step | {"time/shadow": 0.3}, step]
    text = phase_summary(rows, ("generate", "update_actor"))
    lines = text.splitlines()
    assert "  shadow               0.30 s   15.0%" in lines
    # 2 s of steps - 0.6 s of generate/update_actor - 0.3 s of the check = 1.1 s
    assert (
        "  framework overhead (step time outside generate/update_actor and the shadow "
        "check): 1.10 s (55.0%)"
    ) in lines
    assert (
        "  shadow check (RunConfig.shadow_every): 0.30 s in 1 of 2 steps (15.0%), "
        "not in the overhead"
    ) in lines
