"""Metrics trackers and the placement arithmetic (no Ray, no devices)."""

from __future__ import annotations

import json
import re

import pytest

from polyrl.cluster.placement import fit_problems, plan_shares
from polyrl.cluster.roles import RoleSpec
from polyrl.loop.metrics import Tracker, phase_summary, plot_run, read_jsonl


def test_tracker_resume_drops_steps_after_the_checkpoint(tmp_path):
    t = Tracker(tmp_path, tensorboard=False)
    for step in range(1, 6):
        t.log(step, {"reward/mean": step / 10})
    t.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:  # SIGKILL in the middle of a write
        f.write('{"step": 6, "reward/me')
    # The run died after logging step 5 but its last checkpoint, step_3, holds 3 steps.
    t = Tracker(tmp_path, tensorboard=False, resume_step=3)
    t.log(4, {"reward/mean": 0.44})
    t.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["reward/mean"] == 0.44


def test_tensorboard_events_are_written(tmp_path):
    t = Tracker(tmp_path, tensorboard=True)
    t.log(0, {"reward/mean": 0.5})
    t.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_phase_summary_shares_and_overhead():
    rows = [
        {"time/generate": 2.0, "time/update_actor": 1.0, "time/sync_weights": 0.5, "time/step": 4.0}
    ] * 2
    text = phase_summary(rows, ("generate", "update_actor"))
    # total 8 s; generate 4 s = 50%; overhead = 8 - (4 + 2) = 2 s = 25%
    assert "generate             4.00 s   50.0%" in text
    assert "2.00 s (25.0%)" in text


def test_plot_has_a_panel_per_logged_curve(tmp_path):
    """Each curve the Tracker logged is a panel of its own that plots the logged values,
    the phases share the last panel, and summary.png is that figure (issue 47: this test
    once checked only that some PNG over 1000 bytes was written)."""
    from PIL import Image

    from polyrl.loop.metrics import summary_figure

    logged = {
        "reward/mean": [0.1, 0.4, 0.3],
        "actor/entropy": [2.0, 1.5, 1.2],
        "time/generate": [1.0, 0.75, 0.5],
        "time/step": [1.5, 1.25, 1.0],
    }
    t = Tracker(tmp_path, tensorboard=False)
    for i, step in enumerate((1, 2, 3)):
        t.log(step, {key: values[i] for key, values in logged.items()})
    t.close()
    fig = summary_figure(read_jsonl(tmp_path / "metrics.jsonl"))
    shown = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert list(shown) == ["mean reward", "entropy (old policy)", "phase time per step (s)"]

    def plotted(ax, label=None) -> tuple[list, list]:
        (line,) = [ln for ln in ax.lines if label is None or ln.get_label() == label]
        return list(line.get_xdata()), list(line.get_ydata())

    assert plotted(shown["mean reward"]) == ([1, 2, 3], logged["reward/mean"])
    assert plotted(shown["entropy (old policy)"]) == ([1, 2, 3], logged["actor/entropy"])
    phases = shown["phase time per step (s)"]
    assert plotted(phases, "generate") == ([1, 2, 3], logged["time/generate"])
    assert plotted(phases, "step (wall)") == ([1, 2, 3], logged["time/step"])
    png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "s.png")
    assert Image.open(png).size == (1200, 320)  # the three panels: 3 x 4 in by 3.2 in, 100 dpi


def _role(pool: str, workers: int, hosts: int = 1, devices: int = 1) -> RoleSpec:
    return RoleSpec("r", pool, num_workers=workers, hosts=hosts, local_devices=devices)


def test_colocated_gpu_pool_shares_each_gpu():
    pools = {"train": {"GPU": 4, "CPU": 16}, "gen": {"GPU": 4, "CPU": 16}}
    roles = {"actor": _role("train", 4), "reference": _role("train", 4), "rollout": _role("gen", 4)}
    shares = plan_shares(pools, roles)
    # Two roles on each of the train pool's GPUs: half a GPU and 16/4/2 = 2 CPUs per worker.
    assert (shares["actor"].num_gpus, shares["actor"].num_cpus) == (0.5, 2.0)
    assert shares["actor"].colocated_with == ("actor", "reference")
    # The rollout pool is its own: a whole GPU, 4 CPUs per GPU.
    assert (shares["rollout"].num_gpus, shares["rollout"].num_cpus) == (1.0, 4.0)


def test_cpu_pool_is_split_over_all_its_workers():
    shares = plan_shares(
        {"shared": {"CPU": 2}},
        {
            "actor": _role("shared", 2),
            "reference": _role("shared", 1),
            "rollout": _role("shared", 1),
        },
    )
    assert {r: s.num_cpus for r, s in shares.items()} == pytest.approx(
        {"actor": 0.5, "reference": 0.5, "rollout": 0.5}
    )
    assert all(s.num_gpus == 0 for s in shares.values())


def test_jax_host_worker_asks_for_its_share_of_every_local_gpu():
    # One JAX worker drives both GPUs of a node shared with the rollout: 2/2 = 1 GPU of
    # Ray bookkeeping (the placement maps both GPUs to it); on a pool of its own it
    # takes both.
    pools = {"gpu": {"GPU": 2, "CPU": 8}}
    roles = {"actor": _role("gpu", 1, devices=2), "rollout": _role("gpu", 2)}
    shares = plan_shares(pools, roles)
    assert shares["actor"].num_gpus == 1.0 and shares["rollout"].num_gpus == 0.5
    assert plan_shares(pools, {"actor": _role("gpu", 1, devices=2)})["actor"].num_gpus == 2.0


def test_multi_node_pool_splits_cpus_per_node():
    # Per-node CPUs (4) over the workers on one node: actor 2 ranks on each of 2 nodes.
    pools = {"train": {"CPU": 4, "nodes": 2, "trainer": 1}}
    shares = plan_shares(pools, {"actor": _role("train", 4, hosts=2)})
    assert shares["actor"].num_cpus == 2.0


def test_placement_refuses_pools_the_nodes_cannot_hold():
    nodes = [{"CPU": 4.0, "trainer": 1.0}, {"CPU": 4.0}, {"CPU": 1.0, "trainer": 1.0}]
    pools = {"train": {"CPU": 2, "nodes": 2, "trainer": 1}}
    (msg,) = fit_problems(pools, nodes)
    assert "needs 2 node(s)" in msg and "only 1 of the cluster's 3" in msg
    assert fit_problems({"train": {"CPU": 1, "nodes": 2, "trainer": 1}}, nodes) == []


def _run_rows() -> list[dict]:
    """A 3-step run validated before step 1 (a 30 s first evaluation: vLLM's warm-up)
    and after step 3, with the start-up logged on step 1's row."""
    step = {
        "reward/mean": 0.1,
        "val/reward/mean": 0.1,
        "actor/kl_loss": 0.0,
        "actor/entropy": 2.0,
        "response/length_mean": 4.0,
        "time/generate": 0.5,
        "time/update_actor": 0.25,
        "time/step": 1.0,
    }
    return [
        {"step": 0, "val/reward/mean": 0.05, "time/validate": 30.0},
        {"step": 1, **step, "time/step": 2.0, "time/generate": 1.5, "startup/total_s": 60.0,
         "startup/rollout_servers_s": 20.0, "startup/actor_workers_s": 10.0},
        {"step": 2, **step},
        {"step": 3, **step, "time/validate": 0.5},
    ]  # fmt: skip


def test_summary_plot_is_a_grid_without_validation_in_the_phase_times(tmp_path):
    """Issue 34: one 2400 x 320 row of six panels, the phase-time panel swamped by the
    first validation's 30 s bar. Now 3 columns x 2 rows, validation left out."""
    from PIL import Image

    from polyrl.loop.metrics import summary_figure

    fig = summary_figure(_run_rows())
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == [
        "mean reward",
        "validation reward",
        "KL (actor loss term)",
        "entropy (old policy)",
        "response length",
        "phase time per step (s)",
    ]
    # the tallest line is step 1's wall time, 2 s (matplotlib pads the axis by 5%); with
    # validation it would reach 30 s
    assert 2.0 <= shown[-1].get_ylim()[1] < 2.2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _run_rows()))
    png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "summary.png")
    assert Image.open(png).size == (1200, 640)  # 3 x 4 in by 2 x 3.2 in at 100 dpi


def test_phase_summary_reports_the_start_up():
    """Issue 34: 16.5 s of steps in a 93 s run, the rest unaccounted for."""
    text = phase_summary(_run_rows(), ("generate", "update_actor"))
    # steps 2 + 1 + 1 = 4 s, validation 30.5 s, start-up 60 s: 60 / 94.5 = 63.5%
    assert (
        "  start-up: 60.0 s before the first step: rollout servers 20.0 s, actor workers "
        "10.0 s; 63.5% of the run's 94.5 s (start-up + steps + validation)"
    ) in text.splitlines()


def test_start_up_log_names_what_it_waits_for(capsys):
    import time

    from polyrl.loop.metrics import StartupLog

    log = StartupLog(wait_s=0.05)
    with log.phase("rollout servers"):
        time.sleep(0.3)  # 6x the wait: the waiting line has long been printed
    with log.phase("checks"):
        pass
    metrics = log.done()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[start-up] waiting for rollout servers (0.05 s so far)"
    # (sleep may overrun on a busy machine: the tenths are not checked)
    assert re.fullmatch(
        r"\[start-up\] 0\.\d s before the first step, rollout servers 0\.\d s, checks 0\.0 s, "
        r"other 0\.\d s",
        out[1],
    ), out[1]
    assert len(out) == 2  # nothing for the quick phase
    assert set(metrics) == {"startup/total_s", "startup/rollout_servers_s", "startup/checks_s"}
    assert metrics["startup/total_s"] >= 0.3 and metrics["startup/rollout_servers_s"] >= 0.3


def test_the_first_step_names_the_phases_it_waits_for(capsys):
    """Issue 32: a first step that takes long (compiles) says which phase it is in: one
    line per phase still running after the wait, for forwards in flight (begin/record) as
    for timed blocks; nothing for quick phases or later steps."""
    import time

    from polyrl.loop.metrics import PhaseTimer

    def lines_once(*want: str) -> list[str]:  # wait for the timer threads' lines
        out, deadline = "", time.monotonic() + 30
        while not all(w in out for w in want) and time.monotonic() < deadline:
            out += capsys.readouterr().out
            time.sleep(0.01)
        return out.splitlines()

    timer, tail = PhaseTimer(echo=False), "(0.05 s so far: a first call compiles or warms up)"
    with timer.watching(0.05):
        timer.start_step(1)
        with timer.phase("generate"):
            pass
        t0 = timer.begin("reference")  # a forward in flight beside the actor's
        with timer.phase("old_log_probs"):
            first = lines_once("for old_log_probs", "for reference")
        timer.record("reference", t0, time.perf_counter() - t0)
    assert sorted(first) == [
        f"[start-up] step 1 waiting for old_log_probs {tail}",
        f"[start-up] step 1 waiting for reference {tail}",
    ]
    assert timer.times.keys() == {"generate", "reference", "old_log_probs"}
    with timer.watching(0.05, when=False):
        timer.start_step(2)
        with timer.phase("update_actor"):
            time.sleep(0.3)
    assert capsys.readouterr().out == ""


def test_tensorboard_holds_each_step_once_after_a_resume(tmp_path):
    """Issue 47: a run resumed from step 4 logged steps 5..8 again beside the first
    attempt's 5..8, and TensorBoard showed both. Now the resumed writer purges them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(tmp_path, tensorboard=True)
    for step in range(1, 9):
        t.log(step, {"reward/mean": step / 10})
    t.close()
    t = Tracker(tmp_path, tensorboard=True, resume_step=4)  # the checkpoint of step 4
    for step in range(5, 9):
        t.log(step, {"reward/mean": 1 + step / 10})
    t.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")]
    assert got == [(s, s / 10) for s in range(1, 5)] + [(s, 1 + s / 10) for s in range(5, 9)]


def _step_rows(steps, **extra) -> list[dict]:
    return [
        {"step": s, "reward/mean": 0.1 * s, "time/step": 1.0, "time/update_actor": 0.25, **extra}
        for s in steps
    ]


def _panel(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_visible() and ax.get_title() == title]
    return ax


def test_summary_phase_panel_is_honest_about_overlap_and_resumes(tmp_path):
    """Issue 47: phase colours changed with the run's phase set, phases that ran at the
    same time were stacked as if one after the other, resumes were not marked. Now each
    phase is a line of its name's colour under the wall step time, and a dotted line
    marks each resume (the row after it holds the new start's start-up)."""
    from polyrl.loop.metrics import summary_figure

    # async: generation (0.75 s) ran beside the update (0.5 s) in a 1 s step
    ahead = [r | {"time/generate": 0.75, "time/update_actor": 0.5} for r in _step_rows(range(1, 7))]
    ahead[0]["startup/total_s"] = ahead[4]["startup/total_s"] = 9.0  # resumed at step 4
    serial = [r | {"time/reference": 0.25, "time/generate": 0.5} for r in _step_rows(range(1, 4))]
    figs = [summary_figure(ahead), summary_figure(serial)]
    panels = [_panel(fig, "phase time per step (s)") for fig in figs]
    colours = [{ln.get_label(): ln.get_color() for ln in ax.get_lines()} for ax in panels]
    assert colours[0]["generate"] == colours[1]["generate"]
    assert colours[0]["update_actor"] == colours[1]["update_actor"]
    assert len(set(colours[1].values())) == len(colours[1])
    assert not panels[0].patches  # no stacked bars
    # the y axis ends above the 1 s wall time, below 1.25 s (the phases stacked)
    assert 1.0 <= panels[0].get_ylim()[1] < 1.25
    (wall,) = [ln for ln in panels[0].get_lines() if ln.get_label() == "step (wall)"]
    assert list(wall.get_ydata()) == [1.0] * 6
    for ax in figs[0].axes:
        if ax.get_visible():
            resumes = [ln for ln in ax.get_lines() if ln.get_gid() == "resume"]
            assert [ln.get_xdata()[0] for ln in resumes] == [4], ax.get_title()
    assert not [ln for ln in panels[1].get_lines() if ln.get_gid() == "resume"]


@pytest.mark.parametrize(
    "extra, title",
    [
        ({"async/wait_s": 0.1, "rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0},
         "staleness (policy versions)"),
        ({"episode/turns_mean": 2.0, "episode/tool_calls_mean": 1.5},
         "turns and tool calls per episode"),
        ({"shadow/gap_mean/rollout_train": 0.01, "shadow/gap_mean/rollout_shadow": 0.02,
          "shadow/gap_mean/train_shadow": 0.02}, "shadow check: mean log-prob gap"),
        ({"rollout/log_prob_diff_mean": 0.01, "rollout/log_prob_diff_max": 0.1},
         "vLLM vs trainer log-prob gap"),
    ],
)  # fmt: skip
def test_summary_fills_its_free_panel_with_what_the_run_has(extra, title):
    """Issue 47: a run with two curves left one of the grid's three panels empty. Now it
    shows what is specific to the run: staleness (async), turns and tool calls (episodes),
    the shadow check's gaps, else the rollout's log-prob gap to the trainer."""
    from polyrl.loop.metrics import summary_figure

    fig = summary_figure(_step_rows(range(1, 4), **extra))
    shown = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert shown == ["mean reward", title, "phase time per step (s)"]
    lines = _panel(fig, title).get_lines()
    assert len(lines) == len(extra.keys() & _KEYS)  # a line per curve the run logged


_KEYS = {
    "rollout/staleness_mean", "rollout/staleness_max", "episode/turns_mean",
    "episode/tool_calls_mean", "shadow/gap_mean/rollout_train", "shadow/gap_mean/rollout_shadow",
    "shadow/gap_mean/train_shadow", "rollout/log_prob_diff_mean", "rollout/log_prob_diff_max",
}  # fmt: skip


def test_summary_phase_panel_keeps_a_start_s_first_step_off_the_scale():
    """Seen on the real tiny GRPO run (issue 47): step 1 (compiles, warm-up: 10.6 s)
    flattened every later step (0.3 s) to the axis. The first step of each start is
    clipped and its wall time written on the panel."""
    from polyrl.loop.metrics import summary_figure

    rows = _step_rows(range(1, 7))
    for r in rows[0], rows[3]:  # a start, and a resume from step 3 (its steps compile again)
        r |= {"time/step": 10.0 + r["step"], "startup/total_s": 9.0}
    ax = _panel(summary_figure(rows), "phase time per step (s)")
    assert 1.0 <= ax.get_ylim()[1] < 2.0  # the other steps' 1 s fill the panel
    notes = sorted(t.get_text() for t in ax.texts)
    assert notes == ["step 1: 11.0 s", "step 4: 14.0 s"]
