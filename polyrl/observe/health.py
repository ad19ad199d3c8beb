"""Run health: warnings that make a run that learns nothing visible in minutes.

:func:`watch_pending` reports Ray tasks and actors that wait for resources (a user's
verifier task on a cluster whose CPUs the pools hold), instead of a silent hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "reference_moved",
    "HealthMonitor",
    "explained_variance",
    "response_stats",
    "watch_pending",
]


def _demands(gcs_address: str) -> dict[str, int]:
    """Resource requests Ray cannot place right now: ``"{'CPU': 1.0}" -> count``."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(gcs_address)
    out: dict[str, int] = {}
    for demand in status.resource_demands.ray_task_actor_demand:
        for req in demand.bundles_by_count:
            key = str(dict(sorted(req.bundle.items())))
            out[key] = out.get(key, 0) + req.count
    return out


def watch_pending(
    user_cpus: float,
    after_s: float = 60.0,
    every_s: float = 10.0,
    echo: Callable[[str], Any] = print,
) -> threading.Event:
    """Start a daemon thread that reports, once each, resource requests that have waited
    more than ``after_s`` seconds; set the returned event to stop it."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    stop = threading.Event()

    def loop() -> None:
        first_seen: dict[str, float] = {}
        reported: set[str] = set()
        while not stop.wait(every_s):
            try:
                now, pending = time.monotonic(), _demands(gcs)
            except Exception:  # a status call that failed: asked again at the next poll,
                if not ray.is_initialized():  # unless the cluster is going away
                    return
                continue
            first_seen = {k: first_seen.get(k, now) for k in pending}
            for key, since in first_seen.items():
                if now - since >= after_s and key not in reported:
                    reported.add(key)
                    echo(
                        f"[polyrl] WARNING: {pending[key]} Ray task(s)/actor(s) asking for {key} "
                        f"have waited {now - since:.0f} s and cannot be scheduled: Ray has "
                        f"{ray.available_resources()} free. polyrl's pools hold their CPUs; leave "
                        f"room with RunConfig.user_cpus (now {user_cpus:g}) or ask for fewer "
                        f"resources (num_cpus=0 for a light task)"
                    )

    threading.Thread(target=loop, name="polyrl-pending-watch", daemon=True).start()
    return stop


# Each check: (name, what it means and what to check). Printed once, when it first fires.
ADVICE = {
    "rewards_identical": (
        "every response of the step got the same reward ({value}) for {patience} steps: "
        "GRPO advantages are all 0 and nothing is learned. Check that the reward function "
        "parses the responses (rollouts.jsonl shows each response and its reward; put a "
        "breakpoint in it: docs/debugging.md 'Reward mis-parsing')"
    ),
    "responses_empty": (
        "{value:.0%} of the responses are empty. Check SamplingSpec.max_tokens and the stop "
        "tokens (rollouts.jsonl; docs/debugging.md 'Empty or cut rollouts')"
    ),
    "responses_cut": (
        "{value:.0%} of the responses are cut at SamplingSpec.max_tokens before they are as "
        "long as their ground truth: raise max_tokens (rollouts.jsonl shows where they are "
        "cut; docs/debugging.md 'Empty or cut rollouts')"
    ),
    "responses_stop_at_once": (
        "{value:.0%} of the responses end on a stop token right away (one token): check "
        "SamplingSpec.stop_token_ids and the chat template (rollouts.jsonl; docs/debugging.md)"
    ),
    "prompts_dropped": (
        "{value:.0%} of the step's prompts were dropped as longer than "
        "RolloutConfig.max_prompt_len (overlong_prompt='drop'): raise max_prompt_len / "
        "max_model_len or shorten the prompts (polyrl validate-dataset)"
    ),
    "kl_exploding": (
        "the KL to the reference is {value:.3g} (non-finite or above {kl_limit:g}): the policy "
        "is running away; lower the learning rate or raise the KL coefficient"
    ),
    "entropy_exploding": (
        "the policy entropy is {value:.3g}, non-finite or above {entropy_factor:g}x its first "
        "value: the policy is degenerating towards noise; lower the learning rate"
    ),
    "critic_non_finite": (
        "critic values or loss are not finite ({value}): lower critic/OptimConfig.lr, check "
        "the reward scale (docs/debugging.md 'Critic blow-up')"
    ),
    "critic_loss_growing": (
        "the critic loss is {value:.3g}, more than {growth:g}x its median so far or {growth:g}x "
        "the loss of a critic that predicts 0: lower critic/OptimConfig.lr or clip the value "
        "loss (docs/debugging.md 'Critic blow-up')"
    ),
    "value_ev_collapsed": (
        "the critic's explained variance is {value:.3g} (below {ev_floor:g}: worse than "
        "predicting the mean return): its values no longer track the returns; lower "
        "critic/OptimConfig.lr (docs/debugging.md 'Critic blow-up')"
    ),
    "tools_never_called": (
        "tools are offered to the model but no episode called one for {patience} steps: "
        "check that the prompt or system message asks for them, that the chat template "
        "renders the tools (rollouts.jsonl shows each prompt) and that Env.tool_parser "
        "matches the model's call format (docs/agents.md 'Health warnings')"
    ),
    "tool_calls_failing": (
        "{value:.0%} of the tool calls failed for {patience} steps: look at the tool "
        "messages in rollouts.jsonl (a malformed call, a wrong argument, a timeout) "
        "(docs/agents.md 'Health warnings')"
    ),
    "episodes_cut_at_max_turns": (
        "{value:.0%} of the episodes ended at EpisodeConfig.max_turns for {patience} "
        "steps: the env rarely says done; raise max_turns or check the env's done "
        "condition (docs/agents.md 'Health warnings')"
    ),
    "history_rewritten": (
        "{value:.0%} of the step's episodes rewrote their history (an agent's call did not "
        "extend its previous call, or offered other tools), so each trains only its calls "
        "after its last rewrite: {detail}. Send each call the previous call's messages, "
        "its reply and the new messages, with the same tools on every call "
        "(docs/agents.md 'Exact tokens')"
    ),
    "logprob_side": ("{detail} (docs/diagnosis.md)"),
    "phase_slow": (
        "{detail} is {value:.3g}x its median so far: look at the timeline (timeline.json) "
        "for the role that stalls"
    ),
}


def response_stats(batch: Any, tokenizer: Any) -> dict[str, float]:
    """Fractions of the step's responses that are empty, cut at max_tokens (all of them,
    and those cut shorter than their ground truth's token count), or a lone stop token;
    and the fraction of prompts dropped as too long."""
    import numpy as np

    lengths = np.asarray(batch["response_lengths"])
    finish = np.asarray(batch["finish_reason"])
    known = {
        g: len(tokenizer.encode(g, add_special_tokens=False))
        for g in set(map(str, batch["ground_truth"]))
    }
    truth = np.array([known[str(g)] for g in batch["ground_truth"]])
    dropped = len(batch.info.get("dropped", ()))
    prompts = len(lengths) // max(int(batch.info.get("n", 1)), 1) + dropped
    return {
        "response/empty_fraction": float(np.mean(lengths == 0)),
        "response/cut_fraction": float(np.mean(finish == "length")),
        "response/cut_short_fraction": float(np.mean((finish == "length") & (lengths < truth))),
        "response/stop_at_once_fraction": float(np.mean((finish == "stop") & (lengths <= 1))),
        "rollout/dropped_prompt_fraction": dropped / max(prompts, 1),
    }


def explained_variance(values: Any, returns: Any, mask: Any) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over valid tokens (1: perfect,
    0: no better than the mean return, below 0: worse)."""
    import numpy as np

    m = np.asarray(mask, bool)
    r, v = np.asarray(returns, np.float64)[m], np.asarray(values, np.float64)[m]
    var = r.var()
    return float(1.0 - (r - v).var() / var) if var > 1e-12 else 1.0


class HealthMonitor:
    """Checks each step's metrics for the signs of a run that learns nothing; a warning
    is printed once (with what to check) and every check is logged as ``health/<name>``
    (1.0 on a step where it fires)."""

    def __init__(
        self,
        echo: Callable[[str], Any] = print,
        patience: int = 3,
        majority: float = 0.5,
        kl_limit: float = 5.0,
        entropy_factor: float = 1.5,
        growth: float = 100.0,
        ev_floor: float = -1.0,
        slow_factor: float = 5.0,
        slow_min_s: float = 1.0,
        shadow_tolerance: float = 0.02,
        shadow_sides: dict[str, str] | None = None,
    ):
        self.echo, self.patience, self.majority = echo, patience, majority
        self.params = dict(
            kl_limit=kl_limit,
            entropy_factor=entropy_factor,
            growth=growth,
            ev_floor=ev_floor,
            patience=patience,
        )
        self.slow_factor, self.slow_min_s = slow_factor, slow_min_s
        self.shadow_tolerance, self.shadow_sides = shadow_tolerance, shadow_sides or {}
        self.streak: dict[str, int] = {}
        self.history: dict[str, list[float]] = {}
        self.warned: set[str] = set()

    def _seen(self, key: str, value: float) -> list[float]:
        """Values of ``key`` before this step; records this one."""
        past = self.history.setdefault(key, [])
        before = list(past)
        past.append(value)
        return before

    def _fire(self, name: str, cond: bool, value: Any, sustained: bool = False, detail: str = ""):
        streak = self.streak.get(name, 0) + 1 if cond else 0
        self.streak[name] = streak
        firing = streak >= (self.patience if sustained else 1)
        if firing and name not in self.warned:
            self.warned.add(name)
            msg = ADVICE[name].format(value=value, detail=detail, **self.params)
            self.echo(f"[health] WARNING {name}: {msg}")
        return float(firing)

    def check(self, metrics: dict[str, float], scores: Any = None) -> dict[str, float]:
        """``health/*`` metrics for one step; ``scores``: the step's rewards."""
        import numpy as np

        m, out, maj = metrics, {}, self.majority
        if scores is not None and len(scores) > 1:
            same = bool(np.ptp(np.asarray(scores)) == 0)
            out["rewards_identical"] = self._fire(
                "rewards_identical", same, float(scores[0]), sustained=True
            )
        for name, key in (
            ("responses_empty", "response/empty_fraction"),
            ("responses_cut", "response/cut_short_fraction"),
            ("responses_stop_at_once", "response/stop_at_once_fraction"),
        ):
            if key in m:
                out[name] = self._fire(name, m[key] > maj, m[key])
        if "rollout/dropped_prompt_fraction" in m:
            v = m["rollout/dropped_prompt_fraction"]
            out["prompts_dropped"] = self._fire("prompts_dropped", v > 0, v)
        for key in ("actor/kl_loss", "kl_in_reward/kl"):
            if key in m:
                v = m[key]
                out["kl_exploding"] = self._fire(
                    "kl_exploding", not np.isfinite(v) or v > self.params["kl_limit"], v
                )
        if "actor/entropy" in m:
            v, first = m["actor/entropy"], self._seen("actor/entropy", m["actor/entropy"])
            limit = self.params["entropy_factor"] * first[0] if first else np.inf
            out["entropy_exploding"] = self._fire(
                "entropy_exploding", not np.isfinite(v) or v > limit, v
            )
        if "episode/turns_mean" in m:
            out |= self._episodes(m)
        if "critic/loss" in m:
            out |= self._critic(m)
        if "shadow/gap_mean/train_shadow" in m:
            out |= self._three_way(m)
        out |= self._phases(m)
        return {f"health/{k}": v for k, v in out.items()}

    def _episodes(self, m: dict[str, float]) -> dict[str, float]:
        """Multi-turn episodes (``polyrl.rollout.episodes`` metrics)."""
        calls = m.get("episode/tool_calls_mean", 0.0)
        never = m.get("episode/tools_offered", 0.0) > 0 and calls == 0
        failing = calls > 0 and m.get("episode/tool_error_share", 0.0) > self.majority
        cut = m.get("episode/finish/max_turns", 0.0)
        rewrote = m.get("episode/history_rewrite_share", 0.0)
        return {
            "tools_never_called": self._fire("tools_never_called", never, 0, sustained=True),
            "tool_calls_failing": self._fire(
                "tool_calls_failing", failing, m.get("episode/tool_error_share"), sustained=True
            ),
            "episodes_cut_at_max_turns": self._fire(
                "episodes_cut_at_max_turns", cut > self.majority, cut, sustained=True
            ),
            "history_rewritten": self._fire(
                "history_rewritten", rewrote > self.majority, rewrote, detail=_rewrites(m)
            ),
        }

    def _critic(self, m: dict[str, float]) -> dict[str, float]:
        import numpy as np

        keys = ("critic/loss", "critic/vpred_mean", "critic/explained_variance")
        bad = {k: m[k] for k in keys if k in m and not np.isfinite(m[k])}
        out = {"critic_non_finite": self._fire("critic_non_finite", bool(bad), bad)}
        loss, past = m["critic/loss"], self._seen("critic/loss", m["critic/loss"])
        growth, zero = self.params["growth"], m.get("critic/zero_value_loss")
        growing = (len(past) >= 3 and loss > growth * max(np.median(past), 1e-8)) or (
            zero is not None and loss > growth * max(zero, 1e-8)
        )
        out["critic_loss_growing"] = self._fire("critic_loss_growing", growing, loss)
        if "critic/explained_variance" in m:
            ev = m["critic/explained_variance"]
            out["value_ev_collapsed"] = self._fire(
                "value_ev_collapsed", ev < self.params["ev_floor"], ev, sustained=True
            )
        return out

    def _three_way(self, m: dict[str, float]) -> dict[str, float]:
        """The shadow check (``polyrl.observe.shadow``): name the side whose log-probs disagree."""
        from polyrl.observe.shadow import PAIRS, odd_side

        side = odd_side(m, self.shadow_tolerance)
        gaps = ", ".join(f"{a}-{b} {m[f'shadow/gap_mean/{a}_{b}']:.3g}" for a, b in PAIRS)
        stack = lambda s: f"{s} ({self.shadow_sides.get(s, s)})"  # noqa: E731
        if side == "all":
            detail = f"the three log-prob sides disagree with each other (mean gaps {gaps})"
        else:
            detail = (
                (
                    f"the {stack(side)} log-probs disagree with the two others, which agree "
                    f"(mean gaps per token: {gaps}; tolerance {self.shadow_tolerance:g}); the "
                    f"worst tokens are in <run_dir>/shadow/"
                )
                if side
                else ""
            )
        return {"logprob_side": self._fire("logprob_side", side is not None, side, detail=detail)}

    def _phases(self, m: dict[str, float]) -> dict[str, float]:
        import numpy as np

        worst, detail = 0.0, ""
        totals = ("time/step", "time/overhead")
        for key in sorted(k for k in m if k.startswith("time/") and k not in totals):
            past = self._seen(key, m[key])
            if len(past) >= 5 and m[key] >= self.slow_min_s:
                ratio = m[key] / max(float(np.median(past)), 1e-6)
                if ratio > worst:
                    worst, detail = ratio, f"phase {key[5:]} took {m[key]:.2f} s, which"
        slow = worst > self.slow_factor
        return {"phase_slow": self._fire("phase_slow", slow, worst, detail=detail)}


def _rewrites(m: dict[str, float]) -> str:
    """What the step's rewrites changed (``episode/rewrite/...`` metrics), most common first."""
    prefix = "episode/rewrite/"
    found = sorted(
        ((v, k[len(prefix) :]) for k, v in m.items() if k.startswith(prefix) and v > 0),
        reverse=True,
    )
    parts = []
    for share, what in found:
        kind, _, rest = what.partition("/")
        if kind == "message":
            index, role = rest.split("/", 1)
            text = f"message {index} ({role}) differed from the previous call's"
        elif kind == "tool_added":
            text = f"tool {rest!r} offered, not on the previous call"
        elif kind == "tool_removed":
            text = f"tool {rest!r} offered on the previous call, not on the next"
        else:
            text = "the tools' definitions changed"
        parts.append(f"{text} ({share:.0%} of the episodes)")
    return "; ".join(parts) or "what differed was not recorded"


def reference_moved(
    before: Any, after: Any, role: str = "reference", tol: float = 1e-4
) -> str | None:
    """Run-time role isolation: the frozen ``role``'s log-probs of one batch, before and
    after the first actor update. A warning when they moved (shared weights). The same
    workers score the same batch alike up to ``tol``, which allows for kernels whose
    reductions are not bitwise reproducible (GPU; on CPU 1.4e-6 was seen)."""
    import numpy as np

    diff = float(np.max(np.abs(np.asarray(before, np.float64) - np.asarray(after, np.float64))))
    if diff <= tol:
        return None
    return (
        f"WARNING: the {role} role's log-probs moved by up to {diff:.3g} after the first actor "
        f"update (tolerance {tol:g}): the {role} is not a frozen, separate copy; check that it "
        f"is built from RunConfig.model_path in its own workers and never receives the actor's "
        f"weights"
    )
