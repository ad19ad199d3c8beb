"""The role table (polyrl.cluster.roles): built once from RunConfig + AlgorithmSpec; each
backend's registry entry decides its process layout; validation names the binding."""

import pytest

from polyrl.algos import get_algorithm
from polyrl.cluster.roles import build_roles, role_problems
from polyrl.config import OptimConfig
from polyrl.configure.launch import parse_config
from polyrl.configure.validate import check_run

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
    "actor/polyrl.RoleConfig.pool = 'train'",
    "reference/polyrl.RoleConfig.pool = 'gen'",
    "polyrl.RolloutConfig.pool = 'gen'",
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
    assert "actor/ParallelConfig.mesh" in msg and "tensor-parallel group of 2" in msg
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
        "actor/polyrl.RoleConfig.pool = 'train'",
        "reference/polyrl.RoleConfig.pool = 'gen'",
        "polyrl.RolloutConfig.pool = 'gen'",
        "actor/polyrl.ParallelConfig.mesh = {'data': 1, 'fsdp': 4}",
    )
    problems = role_problems(cfg, build_roles(cfg, spec))
    assert any("HSDP" in p for p in problems)
    cfg, spec = _cfg(
        tmp_path,
        "polyrl.RunConfig.pools = {'train': {'CPU': 4, 'GPU': 2}, 'gen': {'CPU': 1}}",
        "actor/polyrl.RoleConfig.pool = 'train'",
        "reference/polyrl.RoleConfig.pool = 'gen'",
        "polyrl.RolloutConfig.pool = 'gen'",
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
    from polyrl.cluster.ray_session import local_cpus

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
        match=r"ModelConfig\.checkpoint_policy='selectiv' is not one of \['full', 'selective', "
        r"'budget'\]; did you mean 'selective'\?",
    ):
        ModelConfig("/models/m", gradient_checkpointing=True, checkpoint_policy="selectiv")
    with pytest.raises(ValueError, match=r"ModelConfig\.activation_memory_budget=0 must be in"):
        ModelConfig("/models/m", checkpoint_policy="budget", activation_memory_budget=0)


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
    from polyrl.configure.validate import ConfigError

    with pytest.raises(ConfigError, match=r"LoraConfig.target_modules has 'qproj'.*'q_proj'"):
        parse_config(
            [LORA],
            [
                f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}",
                "polyrl.LoraConfig.target_modules = ('qproj',)",
            ],
        )


# --------------------------------------------------------------------------- one vocabulary
PPO, DPO, SFT = (f"gin/experiments/tiny_{a}.gin" for a in ("ppo", "dpo", "sft"))


@pytest.mark.parametrize(
    ("gin_file", "started", "printed"),
    [
        (GRPO, ["actor", "rollout", "reference"], "actor, rollout, reference, reward"),
        (PPO, ["actor", "rollout", "reference", "critic"], "actor, rollout, reference, critic, "),
        (DPO, ["actor", "reference"], "actor, reference; "),  # no rollout, no reward workers
        (SFT, ["actor"], "actor; "),
        ("gin/experiments/tiny_multiturn.gin", None, "actor, rollout, reference, env, reward; "),
    ],
)
def test_the_roles_a_run_starts(tmp_path, capsys, gin_file, started, printed):
    """role_names decides which roles run; validate-config prints those (and the env and
    reward workers) and nothing else."""
    from polyrl.cli import main

    run_dir = f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"
    if started is not None:
        cfg, _ = parse_config([gin_file], [run_dir])
        spec = get_algorithm(cfg.algorithm).replace(**dict(cfg.algo_overrides))
        assert list(build_roles(cfg, spec)) == started
    assert main(["validate-config", "--gin_file", gin_file, "--gin_param", run_dir]) == 0
    assert f"; roles: {printed}" in capsys.readouterr().out


# Each former RunConfig field, a value, and the binding its error must offer instead.
MOVED = [
    ("actor_parallel", "@actor/polyrl.ParallelConfig()", "`actor/polyrl.RoleConfig.parallel"),
    ("ref_parallel", "@reference/polyrl.ParallelConfig()", "`reference/polyrl.RoleConfig.parallel"),
    ("critic_parallel", "@critic/polyrl.ParallelConfig()", "`critic/polyrl.RoleConfig.parallel"),
    ("reward_parallel", "@reward/polyrl.ParallelConfig()", "`reward_model/polyrl.RoleConfig.parallel"),
    ("optim", "@actor/polyrl.OptimConfig()", "`actor/polyrl.RoleConfig.optim"),
    ("critic_optim", "@critic/polyrl.OptimConfig()", "`critic/polyrl.RoleConfig.optim"),
    ("reward_model_path", "'/models/rm'", "`reward_model/polyrl.RoleConfig.model_path = '/models/rm'`"),
    ("role_pools", "{'actor': 'train', 'reward': 'train', 'rollout': 'gen'}",
     "`actor/polyrl.RoleConfig.pool = 'train'`; `reward_model/polyrl.RoleConfig.pool = 'train'`; "
     "`polyrl.RolloutConfig.pool = 'gen'`"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "value", "new"), MOVED, ids=[m[0] for m in MOVED])
def test_a_former_binding_names_its_replacement(tmp_path, old, value, new):
    from polyrl.errors import ConfigError

    gin_file = tmp_path / "old.gin"
    gin_file.write_text(f"include '{GRPO}'\npolyrl.RunConfig.{old} = {value}\n")
    with pytest.raises(ConfigError) as e:
        parse_config([str(gin_file)], [f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"])
    (problem,) = e.value.problems
    assert problem.startswith(f"polyrl.RunConfig.{old} ({gin_file} line 2) is no longer")
    assert f"write {new}" in problem


def test_the_former_reward_scope_points_to_reward_model(tmp_path):
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, "reward/polyrl.ParallelConfig.micro_batch_size = 4")
    (problem,) = e.value.problems
    assert "nothing builds polyrl.ParallelConfig in scope 'reward'" in problem
    assert problem.endswith("did you mean scope 'reward_model'?")


@pytest.mark.parametrize(
    ("role", "field", "value", "problem"),
    [
        ("actor", "optim", None, "actor/polyrl.RoleConfig.optim is None but the actor trains; "
         "bind @polyrl.OptimConfig()"),
        ("reference", "optim", OptimConfig(), "reference/polyrl.RoleConfig.optim is set but the "
         "reference is frozen (no optimizer); unbind it"),
        ("actor", "model_path", "/models/x", "actor/polyrl.RoleConfig.model_path='/models/x': "
         "the actor loads RunConfig.model_path; unbind it"),
    ],
)  # fmt: skip
def test_role_settings_that_do_not_fit_the_role_are_named(tmp_path, role, field, value, problem):
    import dataclasses

    cfg, spec = _cfg(tmp_path)
    own = dataclasses.replace(getattr(cfg, role), **{field: value})
    problems = check_run(dataclasses.replace(cfg, **{role: own}), spec, cluster=False)
    assert any(problem in p for p in problems), problems


def test_the_role_table_decides_engines_facts():
    from polyrl.config import ModelConfig

    facts = {
        role: (m.trainable, m.has_value_head)
        for role in ("actor", "reference", "critic", "reward_model", "shadow")
        for m in [ModelConfig("/m", role=role)]
    }
    assert facts == {
        "actor": (True, False),
        "reference": (False, False),
        "critic": (True, True),  # values per token, a score per sequence
        "reward_model": (False, True),
        "shadow": (False, False),
    }
    with pytest.raises(ValueError, match=r"ModelConfig\.role='reward' is not one of \["):
        ModelConfig("/m", role="reward")  # the rule-reward workers host no engine


def _places_naming_roles(path, text=None):
    """Literal collections, comparisons, conditionals and ``match`` statements in the
    code at ``path`` that name two or more roles, as strings or as ``Role`` members
    (docstrings and comments are not code)."""
    import ast

    from polyrl.role_table import Role

    names = {str(r) for r in Role}

    def role(node):
        if isinstance(node, ast.Constant) and node.value in names:
            return node.value
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Role"
            and node.attr in Role.__members__
        ):
            return str(Role[node.attr])
        return None

    kinds = (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BoolOp, ast.IfExp, ast.Compare, ast.Match)
    out, seen = [], set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if not isinstance(node, kinds) or id(node) in seen:
            continue
        found = {r for n in ast.walk(node) if (r := role(n)) is not None}
        if len(found) >= 2:
            out.append(f"{path}:{node.lineno}: {sorted(found)}")
            seen.update(id(n) for n in ast.walk(node))
    return out


def test_only_the_role_table_lists_roles():
    """docs/design.md "Roles": a module asks polyrl.role_table (Role, ROLE_TABLE, the
    derived tuples, role_names, run_roles) which roles train, carry a value head, host an
    engine, keep their settings where, or start in a run, instead of listing role names
    again, by string or by Role member, in any code of the project (benchmarks too)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    allowed = {
        "polyrl/role_table.py": "the table itself",
        "polyrl/observe/shadow.py": 'the check\'s sides ("rollout", "train", "shadow"), not roles',
        "polyrl/config.py": "_moved translates the former role_pools keys",
        "polyrl/observe/timeline.py": 'phases named "reward" and "reference", mapped to Role members',
        "polyrl/loop/metrics.py": 'PHASE_ORDER: phases named "reward", "reference", "shadow"',
    }
    found = [
        place
        for package in ("polyrl", "backends", "algos", "experiments")
        for path in sorted((root / package).rglob("*.py"))
        if str(path.relative_to(root)) not in allowed
        for place in _places_naming_roles(path)
    ]
    assert found == [], "\n".join(found)


def test_role_listing_check_sees_members_and_strings(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        '"""actor and critic train."""\n'
        "from polyrl.role_table import Role\n"
        "TRAINS = (Role.ACTOR, Role.CRITIC)\n"
        "def f(role, cfg):\n"
        '    heads = {"critic": 1, "reward_model": 2}\n'
        "    light = [Role.ENV] if cfg else [Role.REWARD]\n"
        "    return role == Role.ACTOR or role == 'critic'\n"
    )
    assert sorted(int(p.split(":")[-2]) for p in _places_naming_roles(sample)) == [3, 5, 6, 7]
