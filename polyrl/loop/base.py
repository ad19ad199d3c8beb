"""What every loop shares (RL, preference, SFT): role workers, the run loop, metrics,
checkpoints, exports, and colocated roles taking turns on shared GPUs. The RL loop is
``polyrl.loop.trainer``, the offline ones ``polyrl.loop.offline``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from polyrl import checkpoints
from polyrl.batch import Batch
from polyrl.cluster import reliability
from polyrl.cluster.workers import EngineGroup
from polyrl.config import RunConfig
from polyrl.loop.dumps import RolloutDumps
from polyrl.loop.metrics import (
    PhaseTimer,
    StartupLog,
    Tracker,
    latest_metrics,
    phase_summary,
    plot_run,
    read_jsonl,
)
from polyrl.observe import shadow
from polyrl.observe.health import HealthMonitor
from polyrl.observe.timeline import Timeline
from polyrl.role_table import ENGINE_ROLES, ROLE_TABLE, Role, exported_role, reference_in_actor

__all__ = ["COMPUTE_PHASES", "Loop", "Turns"]

COMPUTE_PHASES = (
    "generate",
    "reference",
    "teacher_log_probs",
    "old_log_probs",
    "values",
    "update_actor",
    "update_critic",
)


class Loop(abc.ABC):
    """What both loops share: role workers, the run loop, metrics, checkpoints."""

    def __init__(self, cfg: RunConfig, spec: Any, components: Any):
        self.cfg, self.spec = cfg, spec
        self.tokenizer, self.prompts = components.tokenizer, components.prompts
        self.placement, self.pool = components.placement, components.pool
        self.roles = components.roles
        # Score exactly the ids the rollout can sample (see ModelConfig.sampling_vocab_size),
        # known before the servers are up: the roles start while vLLM does.
        self.vocab = (
            self.pool.planned_sampling_vocab(len(self.tokenizer)) if self.pool is not None else None
        )
        self.run_dir = Path(cfg.run_dir)
        self.startup = getattr(components, "startup", None) or StartupLog()
        self.timer = PhaseTimer()
        path = self.run_dir / "timeline.json"
        self.timeline = Timeline(path, self.role_workers) if cfg.timeline else None
        if self.timeline is not None:
            self.timer.listeners.append(self.timeline.add)
        self.health = HealthMonitor(
            shadow_tolerance=cfg.shadow_tolerance, shadow_sides=shadow.sides(cfg.backend)
        )
        self.dumps = RolloutDumps(self.run_dir, self.tokenizer, cfg.dump_every, cfg.dump_samples)
        self.actor_loss = spec.make_actor_loss() if spec.needs_actor else None
        self.reference = self.critic = self.reward_model = self.shadow = None
        self.warming: list[tuple[Role, Any]] = []  # RunConfig.warm_up's calls in flight
        self._start_engines()
        self.turns = Turns()  # RLTrainer: colocated roles take turns on shared GPUs
        self.evaluator = None  # RLTrainer with validation data: polyrl.loop.evaluation
        self.start_step = 0

    @property
    def ref_scoring(self) -> tuple[Role, dict[str, Any]] | None:
        """Which role scores reference log-probs, and with which forward arguments: the
        reference, or with LoRA the actor's frozen base with its adapters off
        (``polyrl.cluster.roles.reference_in_actor``); None without a reference."""
        if Role.REFERENCE in self.roles:
            return Role.REFERENCE, {}
        if reference_in_actor(self.cfg, self.spec):
            return Role.ACTOR, {"adapters": False}
        return None

    @property
    def ref_scorer(self) -> tuple[EngineGroup, dict[str, Any]] | None:
        """:attr:`ref_scoring` with the role's worker group."""
        found = self.ref_scoring
        return None if found is None else (getattr(self, found[0]), found[1])

    @abc.abstractmethod
    def step(self, step: int) -> dict[str, float]:
        """One step of the algorithm box; returns the step's metrics."""

    def extra_state(self) -> dict[str, Any]:
        """Loop state besides the engines' that a checkpoint must keep."""
        return {}

    def restore_extra(self, state: dict[str, Any], path: Path) -> None:  # noqa: B027
        """Undo :meth:`extra_state` (and :meth:`save_extra_files` under checkpoint ``path``)
        after the engines were loaded (an optional hook)."""

    def save_extra_files(self, path: Path) -> None:  # noqa: B027 (optional hook)
        """Write loop state that is not JSON (e.g. a batch generated ahead) under ``path``."""

    @property
    def temperature(self) -> float:
        """Log-prob temperature: the sampling temperature (greedy scores at 1); a
        preference loop scores fixed responses at 1."""
        if self.spec.objective != "rl":
            return 1.0
        return float(self.cfg.sampling.temperature) or 1.0

    def check_reference(self, batch: Batch, kwargs: dict[str, Any]) -> None:
        """Role isolation at run time (docs/validation.md): after the first actor update,
        the reference scores the same batch again; a warning names it if it moved."""
        from polyrl.observe.health import reference_moved

        group, extra = self.ref_scorer
        with self.turns.resident(group):
            after = group.forward(batch, **kwargs, **extra)["log_probs"]
        warning = reference_moved(batch["ref_log_probs"], after)
        if warning:
            print(f"[polyrl] {warning}", flush=True)

    def shutdown(self) -> None:
        """End every worker (waiting until each is gone), then free the pools' placement
        groups, so a next run in the same Ray session finds its devices free."""
        for group in self.groups.values():
            group.shutdown()
        self.placement.release()  # last: removing a group kills what still runs in it

    @property
    def groups(self) -> dict[Role, EngineGroup]:
        """The started engine roles' worker groups, by role."""
        # In start-up order (actor first); each group is the attribute named as its role.
        found = {r: getattr(self, r, None) for r in self.roles if ROLE_TABLE[r].kind == "engine"}
        return {role: group for role, group in found.items() if group is not None}

    def role_workers(self) -> list[tuple[str, int, Any]]:
        """Every role worker as (role, rank, Ray actor): where the timeline's spans are."""
        out = [(r, i, w) for r, g in self.groups.items() for i, w in enumerate(g.workers)]
        servers = self.pool.servers if self.pool else ()
        out += [(Role.ROLLOUT, i, s) for i, s in enumerate(servers)]
        rewards = getattr(self, "rewards", None)
        return out + [(Role.REWARD, i, w) for i, w in enumerate(rewards.workers if rewards else ())]

    def _start_engines(self) -> None:
        """Start every engine role of the run (``polyrl.cluster.roles``) side by side, then
        wait for each in start-up order; each role is the attribute named as it is. The
        time the driver spends on a role's start is its start-up phase."""
        first = self.first_calls() if self.cfg.warm_up else {}
        starting = {}
        for role in (r for r in self.roles if ROLE_TABLE[r].kind == "engine"):
            spec = self.roles[role]
            if not ROLE_TABLE[role].value_head:  # it scores tokens
                model = dataclasses.replace(spec.model, sampling_vocab_size=self.vocab)
                spec = dataclasses.replace(spec, model=model)
            with self.startup.phase(f"{role} workers"):
                options = functools.partial(self.placement.options, role)
                starting[role] = EngineGroup(spec, options, wait=False)
        for role, group in starting.items():
            with self.startup.phase(f"{role} workers"):
                group.ready()
            setattr(self, role, group)
            for method, batch, args, kwargs in first.get(role, []):
                self.warming.append((role, group.submit_warm_up(method, batch, *args, **kwargs)))

    def first_calls(self) -> dict[Role, list[tuple[str, Batch, tuple, dict[str, Any]]]]:
        """Each engine role's calls of the first step, ``(method, batch, args, kwargs)``
        on batches of its shapes and columns, for ``RunConfig.warm_up`` to prepare while
        the rest starts (``TrainEngine.warm_up``); none here (a loop that knows them says)."""
        return {}

    def warmed_up(self) -> None:
        """Wait for the warm-ups started with the roles (the start-up phase "warm-up")."""
        if not self.warming:
            return
        with self.startup.phase("warm-up"):
            for role, calls in self.warming:
                try:
                    calls.result()
                except reliability.WorkerDied:
                    raise
                except Exception as e:
                    raise RuntimeError(
                        f"the {role} role's warm-up of its first step failed ({e}); the step "
                        "itself would run the same programs. To compile them in step 1 "
                        "instead, set polyrl.RunConfig.warm_up = False"
                    ) from e
        self.warming = []

    # ------------------------------------------------------------------ the loop
    def run(
        self, resume: bool = False, on_step: Callable[[int, dict[str, float]], None] | None = None
    ) -> dict[str, float]:
        """Steps from the start (or the latest checkpoint with ``resume``) to
        ``total_steps``; ``on_step(step, metrics)`` after each (e.g. Ray Tune's report)."""
        if resume:
            self._restore()
            self.dumps.resume(self.start_step)
        tracker = Tracker(
            self.run_dir,
            self.cfg.tensorboard,
            self.cfg.wandb_project,
            # (no checkpoint yet: nothing kept, the step-0 validation is logged again)
            resume_step=(self.start_step or -1) if resume else None,
        )
        evaluator, total = self.evaluator, self.cfg.total_steps
        guard = reliability.NonFiniteGuard(self.cfg.max_nonfinite_steps)
        startup = self.startup.done()  # logged with the first step
        if self.pool is not None:  # the rollout engine's scheduler limits, read back
            startup |= {f"rollout/{k}": v for k, v in self.pool.limits.items()}
            times = self.pool.start_times or {}  # and where its start went (a phase's parts)
            startup |= {f"startup/rollout_servers/{k}": v for k, v in times.items()}
        try:
            # Row N of metrics.jsonl is the state after N steps: step N's training metrics
            # and the validation of the weights it left (row 0: the initial weights').
            if evaluator and self.start_step == 0 and total > 0:
                with self.startup.watch("the validation of the initial weights (vLLM warms up)"):
                    tracker.log(0, evaluator.evaluate(0))
            for step in range(self.start_step, total):
                first = step == self.start_step
                with self.timer.watching(self.startup.wait_s, when=first):
                    metrics, done = self._profiled(step), step + 1
                metrics |= startup if first else {}
                if evaluator and (evaluator.due(done) or done == total):
                    metrics |= evaluator.evaluate(done)
                with reliability.writing(f"the metrics of step {done}"):
                    tracker.log(done, metrics)
                if self.timeline is not None:
                    self.timeline.flush()
                print(_progress(step, self.cfg.total_steps, metrics), flush=True)
                if self.dumps.text:  # this step's decoded samples, also to TensorBoard
                    tracker.log_text("samples", self.dumps.text, done)
                    self.dumps.text = ""
                if on_step is not None:
                    on_step(step, metrics)
                if guard.observe(step, metrics):
                    self._save(step + 1)
                    raise reliability.RunStopped(
                        reliability.stop_message(
                            f"{guard.streak} consecutive steps had non-finite losses or "
                            f"gradients (polyrl.RunConfig.max_nonfinite_steps="
                            f"{guard.limit}); lower the learning rate or check the data",
                            self.run_dir,
                            checkpoints.latest_checkpoint(self.run_dir),
                        )
                    )
                if self.cfg.save_every and (step + 1) % self.cfg.save_every == 0:
                    self._save(step + 1)
                if self.cfg.export_every and done % self.cfg.export_every == 0:
                    self.export_hf(self.run_dir / "exports" / f"step_{done}", f"step {done}")
            if self.cfg.export_final and total > self.start_step:
                self.export_hf(self.run_dir / "hf", f"step {total} (final)")
        except Exception as e:
            if not reliability.is_fault(e):
                raise
            last = checkpoints.latest_checkpoint(self.run_dir)
            raise reliability.RunStopped(
                reliability.stop_message(str(e), self.run_dir, last)
            ) from e
        finally:
            tracker.close()
            if self.timeline is not None:
                self.timeline.close()
        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        plot_run(self.run_dir / "metrics.jsonl", self.run_dir / "summary.png")
        print(phase_summary(rows, COMPUTE_PHASES), flush=True)
        return latest_metrics(rows)

    def _profiled(self, step: int) -> dict[str, float]:
        """:meth:`step`; where ``step + 1`` is one of ``RunConfig.profile_steps``, with
        every trainer role's worker recording it under its framework's profiler
        (``EngineWorker.profile_start``). The traces and ``summary.json`` (each worker's top
        ops) go to ``<run_dir>/profile/step_<k>/``, each written on its worker's node."""
        if step + 1 not in self.cfg.profile_steps:
            return self.step(step)
        import ray

        out = self.run_dir / "profile" / f"step_{step + 1}"
        workers = {f"{r}_{i}": w for r, i, w in self.role_workers() if r in ENGINE_ROLES}
        ray.get([w.profile_start.remote(str(out), name) for name, w in workers.items()])
        metrics = self.step(step)  # (a failed step abandons the recordings with its workers)
        got = dict(zip(workers, ray.get([w.profile_stop.remote() for w in workers.values()])))
        out.mkdir(parents=True, exist_ok=True)  # (the workers made it on their nodes)
        (out / "summary.json").write_text(json.dumps(got, indent=1))
        first, profile = next(iter(got.items()))
        top = ", ".join(f"{o['name'][:40]} {100 * o['share']:.1f}%" for o in profile["top"][:3])
        print(
            f"[profile] step {step + 1}: {', '.join(got)} traced in {out} (summary.json); "
            f"{first}: {top}",
            flush=True,
        )
        return metrics

    def update(
        self,
        group: EngineGroup,
        loss_fn: Any,
        batch: Batch,
        role: str,
        entropy: bool,
        mini: int,
        unit: int = 1,
    ) -> dict[str, float]:
        """``epochs`` passes over shuffled mini-batches of ``mini`` rows; one optimizer
        step each. Rows are shuffled in units of ``unit`` consecutive rows (2: DPO pairs)."""
        rng = np.random.default_rng([self.cfg.seed, int(batch.info.get("step", 0))])
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.cfg.epochs):
            units = rng.permutation(len(batch) // unit)
            order = (units[:, None] * unit + np.arange(unit)).reshape(-1)
            for start in range(0, len(batch), mini):
                part = batch.take(order[start : start + mini])
                part = part.pad_to_multiple(group.num_workers)
                out = group.train_step(part, loss_fn, temperature=self.temperature, entropy=entropy)
                for k, v in out.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        return {f"{role}/{k}": v / count for k, v in sums.items()}

    def export_hf(self, out: Path, what: str) -> None:
        """The actor's weights (a reward-model run's: the critic's, a sequence classifier)
        as a Hugging Face directory at ``out`` (RunConfig.export_every / export_final),
        written under ``out.tmp`` and renamed when complete."""
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        group = getattr(self, exported_role(self.spec))
        # a phase of its own: the timeline shows the export and the role's span inside it
        with (
            self.timer.phase("export"),
            reliability.writing(f"the {what} export"),
            self.turns.resident(group),
        ):
            group.export_hf(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        print(f"[export] {what}: {out} (Hugging Face format)", flush=True)

    # ------------------------------------------------------------------ checkpoints
    def _engine_parts(self, method: str) -> dict[str, Callable[[str], None]]:
        """Trained role -> a callable running its engines' ``save``/``load`` on a path."""

        def run(group: EngineGroup) -> Callable[[str], None]:
            def call(path: str) -> None:
                with self.turns.resident(group):
                    group.call_all(method, path)

            return call

        return {name: run(g) for name, g in self.groups.items() if ROLE_TABLE[name].trained}

    def _save(self, step: int) -> None:
        with reliability.writing(f"the step-{step} checkpoint"):
            path = checkpoints.save(
                self.run_dir,
                step,
                self._engine_parts("save"),
                self.extra_state(),
                checkpoints.run_manifest(self.cfg, self.spec),
                self.cfg.keep_checkpoints,
                extra_files=self.save_extra_files,
            )
        print(f"[checkpoint] step {step}: {path}", flush=True)

    def _restore(self) -> None:
        path = checkpoints.latest_checkpoint(self.run_dir)
        if path is None:
            print(f"[resume] no checkpoint under {self.run_dir}/checkpoints: starting at step 0")
            return
        from polyrl.backends import exchange  # converts the other backend's checkpoint

        manifest = checkpoints.run_manifest(self.cfg, self.spec)
        state = checkpoints.restore(path, self._engine_parts("load"), manifest, exchange)
        self.start_step = state["step"]
        self.restore_extra(state, path)
        print(f"[resume] from {path} at step {self.start_step}", flush=True)


class Turns:
    """Colocated roles taking turns on shared GPUs (docs/design.md "Placement"), only where the
    placement needs it (``polyrl.cluster.residency.turn_roles``).

    A trainer role in ``roles`` lives in host memory except while a phase uses it
    (``resident``: reload, run, offload); the others stay resident. With ``sleeps`` the
    rollout servers sleep (vLLM sleep mode, level 1: weights kept in host memory) from the
    end of generation until just before the weight sync. Each reload, offload, sleep and
    wake is timed on ``timer`` as a phase of its own (framework overhead, outside every
    compute phase). Built with no roles, every call is a no-op.
    """

    def __init__(
        self,
        roles: frozenset[str] = frozenset(),
        pool: Any = None,
        sleeps: bool = False,
        timer: PhaseTimer | None = None,
    ):
        self.roles, self.pool, self.sleeps = roles, pool, sleeps
        self.timer = timer or PhaseTimer(echo=False)

    def takes_turns(self, group: EngineGroup | None) -> bool:
        return group is not None and group.spec.name in self.roles

    @contextlib.contextmanager
    def resident(self, group: EngineGroup | None) -> Iterator[None]:
        if not self.takes_turns(group):
            yield
            return
        with self.timer.phase("reload"):
            group.call_all("reload")
        try:
            yield
        finally:
            with self.timer.phase("offload"):
                group.call_all("offload")

    def rollout_sleep(self) -> None:
        if self.sleeps:
            with self.timer.phase("rollout_sleep"):
                self.pool.sleep(level=1)

    def rollout_wake(self) -> None:
        if self.sleeps:
            with self.timer.phase("rollout_wake"):
                self.pool.wake_up()


def _progress(step: int, total: int, m: dict[str, float]) -> str:
    done = int(20 * (step + 1) / total)
    bar = "#" * done + "." * (20 - done)
    parts = []
    for key, label in (
        ("reward/mean", "reward"),
        ("actor/rewards/margins", "margin"),
        ("actor/rewards/accuracies", "acc"),
        ("critic/rewards/accuracies", "acc"),
        ("val/pair_accuracy", "val acc"),
        ("actor/nll", "nll"),
        ("actor/kl_loss", "kl"),
        ("actor/entropy", "entropy"),
        ("response/length_mean", "len"),
        ("time/step", "s/step"),
    ):
        if key in m:
            parts.append(f"{label} {m[key]:.3g}")
    return f"[{bar}] step {step + 1}/{total}  " + "  ".join(parts)
