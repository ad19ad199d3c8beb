"""The role table (polyrl.roles): built once from RunConfig + AlgorithmSpec; each
backend's registry entry decides its process layout; validation names the binding."""

import pytest

from polyrl.algos import get_algorithm
from polyrl.launch import parse_config
from polyrl.roles import build_roles, role_problems
from polyrl.validate import check_run

GRPO = "gin/experiments/tiny_grpo.gin"


def _cfg(tmp_path, *params, backend="torch_fsdp"):
    cfg, _ = parse_config(
        [GRPO],
        [
            f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}",
            f"polyrl.RunConfig.backend = {backend!r}",
            *params,
        ],
    )
    return cfg, get_algorithm(cfg.algorithm).replace(**dict(cfg.algo_overrides))


TWO_NODES = [
    "polyrl.RunConfig.pools = {'train': {'CPU': 1, 'nodes': 2, 'trainer': 1}, 'gen': {'CPU': 1}}",
    "polyrl.RunConfig.role_pools = {'actor': 'train', 'reference': 'gen', 'rollout': 'gen'}",
]


@pytest.mark.parametrize(
    ("backend", "workers", "devices"),
    [("torch_fsdp", 4, 1), ("jax_pjit", 2, 2)],  # torch: a rank per device; JAX: per host
)
def test_process_model_comes_from_the_backend_entry(tmp_path, backend, workers, devices):
    cfg, spec = _cfg(
        tmp_path,
        *TWO_NODES,
        "actor/polyrl.ParallelConfig.mesh = {'data': 2, 'fsdp': 2}",
        backend=backend,
    )
    roles = build_roles(cfg, spec)
    assert list(roles) == ["actor", "rollout", "reference"]  # GRPO with a KL loss
    actor = roles["actor"]
    assert (actor.num_workers, actor.hosts, actor.local_devices) == (workers, 2, devices)
    # Node-major: the first half of the workers on the pool's first node.
    assert [actor.slot(r)[0] for r in range(workers)] == [0] * (workers // 2) + [1] * (workers // 2)
    assert roles["reference"].hosts == 1 and roles["rollout"].backend is None
    assert role_problems(cfg, roles) == []


def test_tensor_group_across_nodes_is_refused(tmp_path):
    cfg, spec = _cfg(
        tmp_path, *TWO_NODES, "actor/polyrl.ParallelConfig.mesh = {'data': 1, 'tensor': 2}"
    )
    (msg,) = role_problems(cfg, build_roles(cfg, spec))
    assert "actor_parallel mesh" in msg and "tensor-parallel group of 2" in msg
    assert "inside a node" in msg


def test_fsdp_across_nodes_asks_for_hsdp(tmp_path):
    cfg, spec = _cfg(tmp_path, *TWO_NODES, "actor/polyrl.ParallelConfig.mesh = {'fsdp': 2}")
    (msg,) = role_problems(cfg, build_roles(cfg, spec))
    assert "HSDP" in msg and "set data=2" in msg


def test_per_node_gpus_are_checked_not_only_the_total(tmp_path):
    # 4 GPUs in total, but 2 per node: a JAX host worker over 4 devices cannot fit.
    cfg, spec = _cfg(
        tmp_path,
        "polyrl.RunConfig.pools = {'train': {'CPU': 4, 'GPU': 2, 'nodes': 2}, 'gen': {'CPU': 1}}",
        "polyrl.RunConfig.role_pools = {'actor': 'train', 'reference': 'gen', 'rollout': 'gen'}",
        "actor/polyrl.ParallelConfig.mesh = {'data': 1, 'fsdp': 4}",
    )
    problems = role_problems(cfg, build_roles(cfg, spec))
    assert any("HSDP" in p for p in problems)
    cfg, spec = _cfg(
        tmp_path,
        "polyrl.RunConfig.pools = {'train': {'CPU': 4, 'GPU': 2}, 'gen': {'CPU': 1}}",
        "polyrl.RunConfig.role_pools = {'actor': 'train', 'reference': 'gen', 'rollout': 'gen'}",
        "actor/polyrl.ParallelConfig.mesh = {'data': 1, 'fsdp': 4}",
        backend="jax_pjit",
    )
    (msg,) = role_problems(cfg, build_roles(cfg, spec))
    assert "puts 4 devices on each of its 1 node(s)" in msg and "2 GPUs per node" in msg


def test_uneven_split_over_nodes_names_the_pool(tmp_path):
    cfg, spec = _cfg(tmp_path, *TWO_NODES, "actor/polyrl.ParallelConfig.mesh = {'data': 3}")
    problems = check_run(cfg, spec, cluster=False)
    assert any("3 workers do not split evenly" in p and "['nodes']=2" in p for p in problems)


def test_pool_nodes_must_be_a_whole_number(tmp_path):
    cfg, spec = _cfg(tmp_path, "polyrl.RunConfig.pools = {'shared': {'CPU': 2, 'nodes': 1.5}}")
    (msg,) = role_problems(cfg, build_roles(cfg, spec))
    assert "RunConfig.pools['shared']['nodes']=1.5" in msg


def test_gpu_workers_pin_their_platform_whatever_the_driver_set(monkeypatch):
    """A driver with JAX_PLATFORMS=cpu (this test session has it) must not hand a JAX GPU
    worker host devices: on 2 x H200 the worker saw 4 CPU devices instead of its 2 GPUs."""
    from polyrl.backends.base import get_backend

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    jax_model = get_backend("jax_pjit").process
    assert jax_model.host_env(2, True) == {"JAX_PLATFORMS": "cuda"}
    cpu = jax_model.host_env(2, False)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["XLA_FLAGS"].endswith("count=2")
    assert get_backend("torch_fsdp").process.host_env(1, True) == {}


@pytest.mark.parametrize(("given", "want"), [(None, None), (3.0, 3), (13.0, 13), (2.5, 3)])
def test_a_local_ray_start_gets_a_whole_cpu_count(given, want):
    """Ray 2.60's raylet never registered when ray.init got num_cpus=13.0 on a GPU host."""
    from polyrl.ray_session import local_cpus

    got = local_cpus(given)
    assert got == want and (got is None or type(got) is int)


def test_attention_binding_reaches_every_engine(tmp_path):
    cfg, spec = _cfg(tmp_path, "polyrl.RunConfig.attn_implementation = 'polyrl_varlen'")
    roles = build_roles(cfg, spec)
    engines = [r for r in roles.values() if r.model is not None]
    assert {r.name for r in engines} == {"actor", "reference"}
    assert {r.model.attn_implementation for r in engines} == {"polyrl_varlen"}


def test_checkpoint_bindings_reach_every_engine(tmp_path):
    cfg, spec = _cfg(
        tmp_path,
        "polyrl.RunConfig.gradient_checkpointing = True",
        "polyrl.RunConfig.checkpoint_policy = 'selective'",
    )
    engines = [r.model for r in build_roles(cfg, spec).values() if r.model is not None]
    assert {(m.gradient_checkpointing, m.checkpoint_policy) for m in engines} == {
        (True, "selective")
    }


def test_bad_checkpoint_policy_names_field_value_and_choices():
    from polyrl.config import ModelConfig

    with pytest.raises(
        ValueError,
        match=r"ModelConfig\.checkpoint_policy='selectiv' is not one of \['full', 'selective'\]; "
        r"did you mean 'selective'\?",
    ):
        ModelConfig("/models/m", gradient_checkpointing=True, checkpoint_policy="selectiv")


LORA = "gin/experiments/tiny_grpo_lora.gin"


def test_lora_reference_is_the_actors_base(tmp_path, capsys):
    """With LoRA the reference role is not built (no second copy of the weights); the
    actor carries the LoraConfig, and validate-config says where the reference comes from."""
    from polyrl.cli import main

    cfg, _ = parse_config([LORA], [f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"])
    spec = get_algorithm(cfg.algorithm).replace(**dict(cfg.algo_overrides))
    roles = build_roles(cfg, spec)
    assert list(roles) == ["actor", "rollout"]
    assert roles["actor"].model.lora.rank == 16
    assert (
        main(
            [
                "validate-config",
                "--gin_file",
                LORA,
                "--gin_param",
                f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}",
            ]
        )
        == 0
    )
    assert "reference (the actor's base, LoRA adapters off)" in capsys.readouterr().out


def test_lora_with_torch_tensor_parallelism_is_refused(tmp_path):
    cfg, _ = parse_config(
        [LORA],
        [
            f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}",
            "actor/polyrl.ParallelConfig.mesh = {'data': 1, 'tensor': 2}",
        ],
    )
    spec = get_algorithm(cfg.algorithm).replace(**dict(cfg.algo_overrides))
    problems = role_problems(cfg, build_roles(cfg, spec))
    assert any("tensor=2 with RunConfig.lora" in p and "set tensor=1" in p for p in problems)


def test_lora_binding_errors_name_the_binding(tmp_path):
    from polyrl.validate import ConfigError

    with pytest.raises(ConfigError, match=r"LoraConfig.target_modules has 'qproj'.*'q_proj'"):
        parse_config(
            [LORA],
            [
                f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}",
                "polyrl.LoraConfig.target_modules = ('qproj',)",
            ],
        )
