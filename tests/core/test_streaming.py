"""The streaming scheduler (polyrl.loop.streaming) against rollout servers in miniature: the
staleness bound per sample, partial rollouts' per-token versions, staleness 0 as the
synchronous schedule, a dead server's groups lost and counted, DAPO on a stream, and
validate-config's checks of the combination. Real vLLM: tests/rollout/test_pool.py ("the
stream"); whole runs: tests/trainer/test_streaming_runs.py."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from polyrl.algos import get_algorithm
from polyrl.batch import Batch
from polyrl.config import OptimConfig, RoleConfig, RunConfig
from polyrl.envs import EpisodeConfig
from polyrl.loop.async_rollout import async_problems, streaming_problems
from polyrl.loop.streaming import CHUNK_SEED_STRIDE, Stream, multi_version_metrics
from polyrl.rollout import SamplingSpec
from polyrl.rollout.pool import RolloutPool
from polyrl.rollout.sampling import RolloutConfig

PROMPT_LEN = 3


class MiniPool:
    """Rollout servers in miniature, with the real pool's batch assembly. Each sample's
    length is drawn from a long tail (log-normal, seeded by its data batch and index); a
    request samples up to its cap with the version the servers hold; a round sleeps
    ``round_s``; ``fail`` lists rounds whose first server dies (its half of each call is
    lost). A push that lands during a round fails the test."""

    assemble = RolloutPool.assemble
    sample_info = RolloutPool.sample_info

    def __init__(self, round_s=lambda k: 0.0, max_tokens=16, fail=()):
        self.version, self.round_s, self.fail = 0, round_s, set(fail)
        self.config = types.SimpleNamespace(
            prompt_limit=16, overlong_prompt="error", continue_in_place=False
        )
        self.pad_token_id, self.sampling_vocab_size = 0, 50
        self.rounds, self.in_round, self.max_tokens = 0, False, max_tokens
        self.pushed = []

    def length(self, spec, index):
        rng = np.random.default_rng([spec.seed, index % CHUNK_SEED_STRIDE])
        return int(min(1 + rng.lognormal(1.0, 1.0), spec.max_tokens))

    def generate_lossy(self, calls):
        self.in_round, start = True, self.version
        time.sleep(self.round_s(self.rounds))
        outs, failed = [], []
        for requests, spec in calls:
            out = []
            for index, ids, cap in requests:
                done = len(ids) - PROMPT_LEN
                k = min(cap, self.length(spec, index) - done)
                stop = done + k >= self.length(spec, index) and done + k < spec.max_tokens
                out.append(
                    {
                        "token_ids": np.full(k, 7, np.int32),
                        "log_probs": np.full(k, -1.0, np.float32),
                        "finish_reason": "stop" if stop else "length",
                        "text": None,
                        "version": self.version,
                    }
                )
            if self.rounds in self.fail:
                out[: (len(out) + 1) // 2] = [None] * ((len(out) + 1) // 2)
                failed = [0]
            outs.append(out)
        assert self.version == start, "weights changed during a round"
        self.rounds += 1
        self.in_round = False
        return outs, failed

    def push(self, version):
        def run():
            assert not self.in_round, "a push landed in a round"
            self.version = version
            self.pushed.append(version)
            return {}

        return run


def source(per_step):
    def batch(b):
        ids = [[1 + b % 40, 1 + i, 2] for i in range(per_step)]
        return Batch(
            {"prompt_index": np.arange(per_step) + b * per_step},
            {"prompt_ids": ids},
        )

    return batch


def stream(pool, n=4, per_step=4, steps=8, bound=1, chunk=0, **kw):
    def sampling(b):
        return SamplingSpec(n=n, max_tokens=pool.max_tokens, seed=1000 + b)

    return Stream(
        pool,
        source(per_step),
        sampling,
        per_step,
        steps,
        bound,
        chunk_tokens=chunk,
        response_len=pool.max_tokens,
        **kw,
    )


def run(pool, s, steps, train_s=lambda k: 0.0, snapshot=False):
    """The trainer's use of a stream: take, train, push (a copy with ``snapshot``)."""
    rows = []
    for step in range(steps):
        batch, m = s.take(step)
        time.sleep(train_s(step))
        copy = (lambda v=step + 1: pool.push(v)) if snapshot else None
        m |= s.sync(pool.push(step + 1), step + 1, step + 1 == steps, copy)
        rows.append((batch, m))
    s.discard()
    return rows


def check_batch(batch, per_step, n, step, bound):
    """A complete step: ``per_step`` whole groups, token versions non-decreasing along
    each response, the row's version its oldest token's, staleness within the bound."""
    assert len(batch) == per_step * n
    _, counts = np.unique(batch["group_ids"], return_counts=True)
    assert (counts == n).all()
    v, mask = batch["rollout_token_versions"], batch["response_mask"] > 0
    assert ((v >= 0) == mask).all()
    for row in range(len(batch)):
        tokens = v[row][mask[row]]
        assert (np.diff(tokens) >= 0).all()
        assert batch["rollout_weight_version"][row] == tokens.min()
    assert 0 <= step - batch["rollout_weight_version"].min() <= bound


@pytest.mark.parametrize("bound", [1, 2, 4])
@pytest.mark.parametrize("chunk", [0, 3])
def test_staleness_never_exceeds_the_bound(bound, chunk):
    """Long-tailed lengths, random round and training times (seeded): every batch is
    whole groups within ``bound`` versions, each row's version is its oldest token's, the
    buffer never holds more than the bound admits, every push lands between rounds."""
    rng = np.random.default_rng(bound + 10 * chunk)
    rounds, train = rng.exponential(0.002, 10_000), rng.exponential(0.006, 30)
    pool = MiniPool(lambda k: rounds[k])
    rows = run(pool, stream(pool, bound=bound, chunk=chunk, steps=30), 30, lambda k: train[k])
    for step, (batch, m) in enumerate(rows):
        check_batch(batch, 4, 4, step, bound)
        assert m["rollout/staleness_max"] <= bound
        assert m["async/buffer_groups"] <= (bound + 1) * 4
    assert pool.pushed == list(range(1, 31))
    # (the run must have used the room: some batch is older than one version)
    assert max(m["rollout/staleness_max"] for _, m in rows) >= min(bound, 2)


def test_partial_rollouts_carry_the_versions_that_sampled_them():
    """Chunks of 2 tokens, rounds slower than training: pushes land between a sample's
    chunks, so rows carry two or more versions, counted by rollout/multi_version_rows."""
    pool = MiniPool(lambda k: 0.004, max_tokens=16)
    rows = run(pool, stream(pool, bound=2, chunk=2, steps=8), 8, lambda k: 0.001)
    multi = [m["rollout/multi_version_rows"] for _, m in rows]
    assert sum(multi) > 0, multi
    for step, (batch, m) in enumerate(rows):
        check_batch(batch, 4, 4, step, 2)
        assert (
            m["rollout/multi_version_rows"]
            == multi_version_metrics(batch)["rollout/multi_version_rows"]
        )


def test_staleness_0_is_the_synchronous_schedule():
    """max_staleness 0: step k trains data batch k's groups, in order, every token sampled
    by version k (the groups are admitted only once the servers hold it)."""
    pool = MiniPool(lambda k: 0.001)
    rows = run(pool, stream(pool, bound=0, steps=5), 5, lambda k: 0.003)
    for step, (batch, m) in enumerate(rows):
        assert batch["prompt_index"].tolist() == np.repeat(np.arange(4) + 4 * step, 4).tolist()
        assert set(batch["rollout_token_versions"][batch["response_mask"] > 0]) == {step}
        assert m["rollout/staleness_max"] == 0 and m["async/buffer_groups"] == 0
        # the seeds of RolloutPool.generate: sample j of row i is request i * n + j
        lengths = [pool.length(SamplingSpec(max_tokens=16, seed=1000 + step), i) for i in range(16)]
        assert batch["response_lengths"].tolist() == lengths


def test_a_dead_server_loses_only_its_groups():
    """Round 1's first server dies: the groups it held are lost and counted, the others
    finish, and every later step still gets a whole batch."""
    pool = MiniPool(lambda k: 0.001, fail={1})
    rows = run(pool, stream(pool, bound=1, chunk=2, steps=6), 6, lambda k: 0.002)
    lost = sum(m.get("async/lost_groups", 0.0) for _, m in rows)
    assert lost >= 1
    for step, (batch, _) in enumerate(rows):
        check_batch(batch, 4, 4, step, 1)


def test_dynamic_sampling_takes_groups_until_enough_are_kept():
    """DAPO on a stream: ``accept`` keeps only groups of even prompt rows; each step gets
    4 of them (looking at up to 3 x 4 groups), kept_fraction is what it kept of what it
    looked at (4 of k groups: it takes as many as it still needs, and they finish out of
    order), and the filtered groups were replaced by admission. A meta column ``accept``
    adds (an LLM judge's replies) reaches the step's batch, row by row."""

    def accept(batch):
        scores = (batch["prompt_index"] % 2 == 0).astype(np.float32)
        notes = [f"row {i}" for i in batch["prompt_index"]]
        return batch.with_columns({"scores": scores}, {"note": notes}), scores > 0

    pool = MiniPool(lambda k: 0.001)
    rows = run(pool, stream(pool, bound=1, steps=4, accept=accept, max_gen_batches=3), 4)
    for step, (batch, m) in enumerate(rows):
        check_batch(batch, 4, 4, step, 1)
        assert (batch["prompt_index"] % 2 == 0).all() and (batch["scores"] == 1).all()
        assert list(batch["note"]) == [f"row {i}" for i in batch["prompt_index"]]
        looked = 4 / m["dynamic_sampling/kept_fraction"]
        assert looked == pytest.approx(round(looked)) and 4 <= round(looked) <= 12


def test_multi_version_rows_by_hand():
    v = np.array([[0, 0, 1, -1], [2, 2, -1, -1], [-1, -1, -1, -1], [3, 4, 5, 5]])
    batch = Batch({"rollout_token_versions": v})
    assert multi_version_metrics(batch) == {"rollout/multi_version_rows": 2.0}  # rows 0, 3


def test_stream_errors_reach_the_trainer():
    """A round that raises (not a dead server) stops the stream; take() re-raises it."""
    pool = MiniPool()

    def broken(calls):
        raise ValueError("bad request")

    pool.generate_lossy = broken
    s = stream(pool)
    with pytest.raises(ValueError, match="bad request"):
        s.take(0)
    s.discard()
    assert not [t for t in threading.enumerate() if t.name == "polyrl-stream" and t.is_alive()]


def test_validate_config_checks_streaming():
    grpo, remax, dpo = get_algorithm("grpo"), get_algorithm("remax"), get_algorithm("dpo")
    (p,) = streaming_problems(RunConfig(run_dir="r", partial_rollout_tokens=8), grpo)
    assert "RunConfig.partial_rollout_tokens=8 needs RunConfig.streaming=True" in p
    (p,) = streaming_problems(RunConfig(run_dir="r", partial_rollout_tokens=-1), grpo)
    assert "RunConfig.partial_rollout_tokens=-1 must be an integer >= 0" in p
    turns = RunConfig(run_dir="r", streaming=True, episodes=EpisodeConfig())
    assert streaming_problems(turns, grpo) == []  # multi-turn episodes stream
    chunked = RunConfig(
        run_dir="r", streaming=True, episodes=EpisodeConfig(), partial_rollout_tokens=4
    )
    (p,) = streaming_problems(chunked, grpo)
    assert "RunConfig.partial_rollout_tokens=4 with multi-turn episodes" in p
    assert "set RunConfig.partial_rollout_tokens=0" in p
    in_place = RolloutConfig(None, continue_in_place=True)
    (p,) = streaming_problems(RunConfig(run_dir="r", rollout=in_place), grpo)
    assert "RolloutConfig.continue_in_place=True needs RunConfig.streaming=True" in p
    assert streaming_problems(RunConfig(run_dir="r", streaming=True, rollout=in_place), grpo) == []
    with pytest.raises(
        ValueError,
        match="continue_in_place=True .*engine='sync' cannot .* set RolloutConfig.engine='async'",
    ):
        RolloutConfig(None, engine="sync", continue_in_place=True)
    RolloutConfig(None, continue_in_place=True)  # the default engine, "async"
    (p,) = streaming_problems(RunConfig(run_dir="r", streaming=True), remax)
    assert "RunConfig.streaming=True is not supported here: ReMax" in p
    (p,) = streaming_problems(RunConfig(run_dir="r", streaming=True), dpo)
    assert "'dpo' (preference) has no rollouts" in p
    split = dict(
        run_dir="r",
        streaming=True,
        pools={"train": {"CPU": 1, "GPU": 1}, "gen": {"CPU": 1, "GPU": 1}},
        actor=RoleConfig(optim=OptimConfig(), pool="train"),
        reference=RoleConfig(pool="train"),
        rollout=RolloutConfig(None, pool="gen"),
    )
    (p,) = streaming_problems(RunConfig(**split), grpo)
    assert "separate GPUs needs RunConfig.weight_transport='nccl'" in p
    assert "(got 'object_store')" in p
    assert streaming_problems(RunConfig(**split, weight_transport="nccl"), grpo) == []
    # streaming beside training on one GPU whose roles take turns (sleep mode): refused
    one_gpu = RunConfig(
        run_dir="r",
        streaming=True,
        max_staleness=1,
        pools={"shared": {"CPU": 2, "GPU": 1}},
        rollout=RolloutConfig(None),
    )
    (p,) = async_problems(one_gpu, grpo)
    assert "RunConfig.max_staleness=1 with RunConfig.streaming=True" in p
    assert "polyrl.RolloutConfig.pool" in p


GPU_POOL = 'polyrl.RunConfig.pools = {"shared": {"CPU": 2, "GPU": 1}}'


@pytest.mark.parametrize(
    ("gin_file", "params", "engine"),
    [
        ("gpu_grpo_0p5b.gin", [], "async"),  # single-turn on a GPU: as fast as LLM.generate
        ("tiny_grpo.gin", [GPU_POOL], "async"),
        ("tiny_grpo.gin", [], "async"),
        ("tiny_multiturn.gin", [], "async"),
        ("tinker_service.gin", [GPU_POOL], "async"),
        ("gpu_grpo_0p5b.gin", ["polyrl.RolloutConfig.engine = 'sync'"], "sync"),  # as bound
        ("tiny_multiturn.gin", ["polyrl.RolloutConfig.engine = 'sync'"], "sync"),  # refused later
    ],
)
def test_every_run_takes_the_asynchronous_engine_unless_bound(tmp_path, gin_file, params, engine):
    """One engine for every run (issue 46): the asynchronous engine sampled the GRPO
    experiment's batches as fast as the synchronous one at the scheduler limits polyrl
    sets (one H100, runs interleaved), so the run-dependent "auto" went; "sync" stays
    for a run that binds it, and "auto" is refused with what replaced it."""
    from polyrl.configure.launch import parse_config

    cfg, _ = parse_config(
        [f"gin/experiments/{gin_file}"], [f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}", *params]
    )
    assert cfg.rollout.engine == engine
    assert cfg.rollout.asynchronous == (engine == "async")
    with pytest.raises(ValueError, match=r"RolloutConfig.engine='auto' is gone: .* bind 'sync'"):
        RolloutConfig(None, engine="auto")


def test_hand_offs_wait_on_events_never_on_a_timer():
    """The producer and its two policies (bounded staleness, streaming with partial
    rollouts and episodes) hand batches and pushes over on a condition variable or an
    asyncio event: no ``sleep`` call anywhere in them (a polling loop would add up to its
    period to every hand-off and burn a core while it waits)."""
    import ast
    import inspect

    from polyrl.loop import async_rollout, producer, streaming

    for module in (producer, async_rollout, streaming):
        calls = [
            node.func
            for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.Call)
        ]
        names = [f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "") for f in calls]
        assert "sleep" not in names, module.__name__
