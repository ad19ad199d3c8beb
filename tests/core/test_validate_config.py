"""validate-config's corpus of wrong configs: each one gets a named error (the binding,
the value and the fix), never a traceback, and each pitfall's fix passes.

Every case runs ``polyrl validate-config`` in-process: an exception escaping ``main``
fails the test, so "no traceback" is checked by every case.
"""

from __future__ import annotations

import json

import pytest

from polyrl.cli import main
from polyrl.data.formats import write_dataset
from polyrl.data.tasks import make_preference_rows, make_rows

GRPO = "gin/experiments/tiny_grpo.gin"
DPO = "gin/experiments/tiny_dpo.gin"
MULTITURN = "gin/experiments/tiny_multiturn.gin"
DISTILL = "gin/experiments/tiny_distill.gin"
RM = "gin/experiments/tiny_rm.gin"
GPU_POOLS = (
    "polyrl.RunConfig.pools = {'train': {'CPU': 1, 'GPU': 2}, 'gen': {'CPU': 1, 'GPU': 4}}",
    "actor/polyrl.RoleConfig.pool = 'train'",
    "reference/polyrl.RoleConfig.pool = 'train'",
    "critic/polyrl.RoleConfig.pool = 'train'",
    "reward_model/polyrl.RoleConfig.pool = 'train'",
    "polyrl.RolloutConfig.pool = 'gen'",
)

# (id, base gin file, bindings, expected text of the error). {data}, {model}, {gin} are
# filled in by the fixture below.
CASES = [
    # gin itself
    ("misspelled-configurable", GRPO, ["polyrl.RunConfg.total_steps = 3"],
     "no configurable named 'polyrl.RunConfg'; did you mean 'polyrl.RunConfig'?"),
    ("misspelled-parameter", GRPO, ["polyrl.RunConfig.total_step = 3"],
     "polyrl.RunConfig has no parameter 'total_step'; did you mean 'total_steps'?"),
    ("unknown-scoped-parameter", GRPO, ["actor/polyrl.OptimConfig.learning_rate = 0.1"],
     "actor/polyrl.OptimConfig.learning_rate (--gin_param"),
    ("lr-as-string", GRPO, ["actor/polyrl.OptimConfig.lr = '3e-3'"],
     "actor/polyrl.OptimConfig.lr = '3e-3' (--gin_param \"actor/polyrl.OptimConfig.lr = '3e-3'\") "
     "is str, expected a number; write it without quotes: actor/polyrl.OptimConfig.lr = 0.003"),
    ("steps-as-string", GRPO, ["polyrl.RunConfig.total_steps = 'ten'"],
     "polyrl.RunConfig.total_steps = 'ten'"),
    ("files-as-string", GRPO, ["polyrl.RunConfig.train_files = 'a.parquet'"],
     "is str, expected a list"),
    ("bool-as-string", GRPO, ["polyrl.RunConfig.tensorboard = 'yes'"],
     "expected True/False"),
    ("syntax-error-param", GRPO, ["polyrl.RunConfig.total_steps = = 3"],
     "gin syntax error in --gin_param 'polyrl.RunConfig.total_steps = = 3' line 1"),
    # issue 34: an unquoted path got "Unable to parse value" without saying to quote it
    ("unquoted-path-param", GRPO, ["polyrl.RunConfig.model_path = /models/qwen"],
     "gin syntax error in --gin_param 'polyrl.RunConfig.model_path = /models/qwen' line 1: "
     "`polyrl.RunConfig.model_path = /models/qwen`: /models/qwen is not a value gin can read; "
     "a string (a path, a name) needs quotes: polyrl.RunConfig.model_path = \"/models/qwen\""),
    ("unquoted-path-file", "{gin}/unquoted.gin", [],
     "unquoted.gin line 2: `polyrl.RunConfig.run_dir = runs/mine`: runs/mine is not a value gin "
     "can read; a string (a path, a name) needs quotes: polyrl.RunConfig.run_dir = \"runs/mine\""),
    ("syntax-error-file", "{gin}/unclosed.gin", [],
     "unclosed.gin: EOF in multi-line statement"),
    ("syntax-error-no-equals", "{gin}/noequals.gin", [],
     "noequals.gin line 2: Couldn't parse statement"),
    ("missing-include", "{gin}/badinclude.gin", [],
     "include 'gin/algos/grpoo.gin' not found"),
    ("missing-required", "{gin}/norundir.gin", [],
     "polyrl.RunConfig.run_dir is REQUIRED and not bound"),
    ("micro-batch-zero", GRPO, ["actor/polyrl.ParallelConfig.micro_batch_size = 0"],
     "actor/polyrl.ParallelConfig: ParallelConfig.micro_batch_size=0 must be >= 1"),
    ("unknown-mesh-axis", GRPO, ["actor/polyrl.ParallelConfig.mesh = {'dat': 1}"],
     "unknown axes ['dat']; valid axes: ['data', 'fsdp', 'tensor']; did you mean 'data'?"),
    ("unknown-overlong-policy", GRPO, ["polyrl.RolloutConfig.overlong_prompt = 'dorp'"],
     "RolloutConfig.overlong_prompt='dorp' is not one of ['error', 'truncate_left', 'drop']; "
     "did you mean 'drop'?"),
    ("misspelled-scope", GRPO, ["actr/polyrl.OptimConfig.lr = 0.1"],
     "actr/polyrl.OptimConfig.lr = 0.1 (--gin_param 'actr/polyrl.OptimConfig.lr = 0.1') is "
     "never used: nothing builds polyrl.OptimConfig in scope 'actr'; did you mean scope 'actor'?"),
    ("unused-scope", GRPO, ["policy/polyrl.ParallelConfig.micro_batch_size = 4"],
     "is never used: nothing builds polyrl.ParallelConfig in scope 'policy'"),
    ("unknown-algorithm", GRPO, ["polyrl.RunConfig.algorithm = 'grop'"],
     "RunConfig.algorithm='grop' is not a registered algorithm"),
    ("unknown-override", GRPO, ["polyrl.RunConfig.algo_overrides = {'kl_los_coef': 0.1}"],
     "RunConfig.algo_overrides['kl_los_coef']: AlgorithmSpec has no field 'kl_los_coef'; "
     "did you mean 'kl_loss_coef'?"),
    ("bad-override-value", GRPO, ["polyrl.RunConfig.algo_overrides = {'agg': 'tokenmean'}"],
     "RunConfig.algo_overrides={'agg': 'tokenmean'}"),
    ("schedule-typo", GRPO, ["actor/polyrl.OptimConfig.schedule = 'cosin'"],
     "OptimConfig.schedule='cosin' is not one of ['constant', 'cosine']; did you mean 'cosine'?"),
    ("top-p-zero", GRPO, ["polyrl.SamplingSpec.top_p = 0.0"],
     "SamplingSpec.top_p=0.0 must be in (0, 1]"),
    ("dtype-typo", GRPO, ["polyrl.RunConfig.model_dtype = 'bf16'"],
     "RunConfig.model_dtype='bf16' is not one of"),
    ("checkpoint-policy-typo", GRPO, ["polyrl.RunConfig.checkpoint_policy = 'selectiv'"],
     "RunConfig.checkpoint_policy='selectiv' is not one of ['full', 'selective', 'budget']; "
     "did you mean 'selective'?"),
    ("budget-without-compile", GRPO, ["polyrl.RunConfig.gradient_checkpointing = True",
                                      "polyrl.RunConfig.checkpoint_policy = 'budget'"],
     "RunConfig: checkpoint_policy='budget' on torch_fsdp needs compile=True "
     "(RunConfig.compile): torch.compile's partitioner chooses what each layer recomputes; "
     "set compile = True, or checkpoint_policy = 'full'"),
    ("budget-out-of-range", GRPO, ["polyrl.RunConfig.activation_memory_budget = 1.5"],
     "RunConfig.activation_memory_budget=1.5 must be in (0, 1]"),
    ("backend-typo", GRPO, ["polyrl.RunConfig.backend = 'pytorch'"],
     "RunConfig.backend='pytorch' is not a registered backend"),
    # pitfall 2: batch arithmetic
    ("prompts-not-multiple", GRPO, ["polyrl.RunConfig.prompts_per_step = 12"],
     "RunConfig.prompts_per_step=12 is not a multiple of RunConfig.mini_batch_prompts=8: every "
     "optimizer step must see the same number of prompts; set prompts_per_step = 16 (2 "
     "mini-batches) or mini_batch_prompts = 6"),
    ("mini-over-prompts", GRPO, ["polyrl.RunConfig.mini_batch_prompts = 32"],
     "RunConfig.mini_batch_prompts=32 exceeds RunConfig.prompts_per_step=16"),
    ("grpo-one-sample", GRPO, ["polyrl.SamplingSpec.n = 1"],
     "SamplingSpec.n=1: algorithm 'grpo' compares samples of the same prompt"),
    ("dp-split", GRPO, ["actor/polyrl.ParallelConfig.mesh = {'data': 3}",
                        "polyrl.RunConfig.mini_batch_prompts = 4",
                        "polyrl.SamplingSpec.n = 2"],
     "RunConfig.mini_batch_prompts=4 x SamplingSpec.n=2 = 8 samples per optimizer step do not "
     "split over the actor's 3 data-parallel shards"),
    ("dpo-odd-micro-batch", DPO, ["actor/polyrl.ParallelConfig.micro_batch_size = 3"],
     "actor/ParallelConfig.micro_batch_size=3 is odd"),
    ("zero-epochs", GRPO, ["polyrl.RunConfig.epochs = 0"],
     "RunConfig.epochs=0 and RunConfig.total_steps=80 must be >= 1"),
    ("cosine-too-short", GRPO, ["actor/polyrl.OptimConfig.schedule = 'cosine'",
                                "actor/polyrl.OptimConfig.total_steps = 10"],
     "OptimConfig.total_steps=10 is fewer than the run's optimizer steps"),
    ("model-len-too-short", GRPO, ["polyrl.RolloutConfig.max_model_len = 34",
                                   "polyrl.SamplingSpec.max_tokens = 8"],
     "RolloutConfig.max_model_len=34 is shorter than the prompt limit (32)"),
    ("profile-step-outside", GRPO, ["polyrl.RunConfig.profile_steps = [0, 3, 81]"],
     "RunConfig.profile_steps=[0, 3, 81]: [0, 81] are not steps of this run (1 to "
     "RunConfig.total_steps=80)"),
    ("shadow-negative", GRPO, ["polyrl.RunConfig.shadow_every = -1"],
     "RunConfig.shadow_every=-1 must be an int >= 0 (0: no shadow check)"),
    ("shadow-without-rollouts", DPO, ["polyrl.RunConfig.shadow_every = 5"],
     "RunConfig.shadow_every=5: algorithm 'dpo' samples no rollouts"),
    ("shadow-per-prompt-zero", GRPO, ["polyrl.RunConfig.shadow_per_prompt = 0"],
     "RunConfig.shadow_per_prompt=0 must be an int >= 1"),
    ("bucket-zero", GRPO, ["polyrl.RunConfig.weight_bucket_mb = 0"],
     "RunConfig.weight_bucket_mb=0 must be > 0 (MiB per weight-sync bucket); leave it unbound"),
    ("truncated-sampling", GRPO, ["polyrl.SamplingSpec.top_p = 0.9"],
     "SamplingSpec.top_p=0.9 / top_k=0: truncated sampling"),
    # pitfall 1: role isolation
    ("kl-without-reference", GRPO,
     ["polyrl.RunConfig.algo_overrides = {'use_kl_loss': False, 'kl_loss_coef': 0.01}"],
     "RunConfig.algo_overrides sets kl_loss_coef=0.01 but 'grpo' has use_kl_loss=False, so no "
     "reference model is built"),
    ("kl-reward-without-reference", GRPO, ["polyrl.RunConfig.algo_overrides = {'kl_coef': 0.05}"],
     "sets kl_coef=0.05 but 'grpo' has kl_in_reward=False"),
    ("reward-model-is-causal-lm", GRPO, ["reward_model/polyrl.RoleConfig.model_path = '{model}'"],
     "checkpoint with no score head"),
    ("reward-model-missing", GRPO, ["reward_model/polyrl.RoleConfig.model_path = '{data}/nope'"],
     "/nope' has no config.json"),
    ("model-missing", GRPO, ["polyrl.RunConfig.model_path = '{data}/nope'"],
     "RunConfig.model_path='{data}/nope' has no config.json"),
    # pitfall 3: placement
    ("cuda-ipc-across-pools", GRPO, [*GPU_POOLS, "polyrl.RunConfig.weight_transport = 'cuda_ipc'"],
     "RunConfig.weight_transport='cuda_ipc' shares GPU memory, so it needs the actor and rollout"),
    ("transport-typo", GRPO, ["polyrl.RunConfig.weight_transport = 'nccll'"],
     "RunConfig.weight_transport='nccll' is not one of"),
    ("role-in-missing-pool", GRPO, ["polyrl.RolloutConfig.pool = 'gen'"],
     "polyrl.RolloutConfig.pool='gen' (rollout) is not a pool in RunConfig.pools"),
    ("mesh-over-pool", GRPO, [*GPU_POOLS, "actor/polyrl.ParallelConfig.mesh = {'fsdp': 4}"],
     "actor/ParallelConfig.mesh {'data': 1, 'fsdp': 4, 'tensor': 1} puts 4 devices on each of its 1 "
     "node(s) but pool 'train' has 2 GPUs per node"),
    ("train-tp-spans-node", GRPO, [*GPU_POOLS, "actor/polyrl.ParallelConfig.mesh = {'tensor': 4}"],
     "actor/ParallelConfig.mesh tensor=4: a tensor-parallel group would span nodes, but pool "
     "'train' has 2 GPUs per node; tensor parallelism stays inside a node: set tensor <= 2"),
    ("train-tp-splits-heads", GRPO, ["reference/polyrl.ParallelConfig.mesh = {'tensor': 3}"],
     "reference/ParallelConfig.mesh tensor=3: the model's num_attention_heads=4, "
     "num_key_value_heads=2, intermediate_size=256 does not split over 3 tensor-parallel ranks; "
     "set tensor to one of [1, 2]"),
    ("compile-with-tensor-parallel", GRPO, ["polyrl.RunConfig.compile = True",
                                            "reference/polyrl.ParallelConfig.mesh = {'tensor': 2}"],
     "reference/ParallelConfig.mesh tensor=2 with ModelConfig.compile=True (RunConfig.compile): "
     "torch.compile of tensor-parallel decoder layers fails in the torch_fsdp backend; set "
     "compile=False, or tensor=1"),
    ("tp-not-dividing-pool", GRPO, [*GPU_POOLS, "polyrl.RolloutConfig.tensor_parallel_size = 3"],
     "RolloutConfig.tensor_parallel_size=3 does not divide pool 'gen' (4 GPUs per node): 4 % 3 = "
     "1 GPUs would idle and a group cannot leave its node; use one of [1, 2, 4]"),
    ("servers-over-pool", GRPO, [*GPU_POOLS, "polyrl.RolloutConfig.tensor_parallel_size = 2",
                                 "polyrl.RolloutConfig.num_servers = 3"],
     "RolloutConfig.num_servers=3 x tensor_parallel_size=2 = 6 GPUs, but pool 'gen' has 4; "
     "set num_servers = 2"),
    ("gpus-not-on-machine", GRPO, list(GPU_POOLS),
     "RunConfig.pools asks for 6 GPUs but this machine has 0"),
    ("cuda-visible-devices-by-hand", GRPO,
     ["polyrl.RolloutConfig.env = (('CUDA_VISIBLE_DEVICES', '0,1'),)"],
     "RolloutConfig.env sets CUDA_VISIBLE_DEVICES='0,1': Ray assigns each worker its GPUs"),
    ("device-ids-in-pool", GRPO,
     ["polyrl.RunConfig.pools = {'shared': {'CPU': 2, 'GPU': 0, 'device_ids': 1}}"],
     "RunConfig.pools['shared']['device_ids']=1: device ids cannot be chosen by hand"),
    ("pool-resource-lowercase", GRPO, ["polyrl.RunConfig.pools = {'shared': {'CPU': 2, 'gpus': 1}}"],
     "RunConfig.pools['shared']['gpus']: Ray calls this resource 'GPU'"),
    # pitfall 4: datasets
    ("train-file-missing", GRPO, ["polyrl.RunConfig.train_files = ['{data}/missing.parquet']"],
     "RunConfig.train_files: {data}/missing.parquet: file '{data}/missing.parquet' does not exist"),
    ("unregistered-data-source", GRPO, ["polyrl.RunConfig.train_files = ['{data}/mystery.parquet']"],
     "row 0: data_source='mystery/task' has no reward function"),
    ("dataset-smaller-than-step", GRPO, ["polyrl.RunConfig.train_files = ['{data}/eight.parquet']"],
     "RunConfig.prompts_per_step=16 exceeds the 8 training rows (RunConfig.train_files)"),
    ("task-smaller-than-step", GRPO, ["polyrl.RunConfig.n_train_prompts = 10"],
     "RunConfig.prompts_per_step=16 exceeds the 10 training rows (RunConfig.n_train_prompts)"),
    ("dpo-on-rl-file", DPO, ["polyrl.RunConfig.train_files = ['{data}/copy.parquet']"],
     "64 rows (row 0, row 1, row 2, ...): missing field 'chosen'"),
    ("long-prompts-error", GRPO, ["polyrl.RunConfig.train_files = ['{data}/long.parquet']"],
     "RunConfig.train_files: {data}/long.parquet: every prompt (32 rows) is over "
     "RolloutConfig.max_prompt_len=32 tokens (the shortest is 70 tokens after the chat template)"),
    ("drop-leaves-nothing", GRPO, ["polyrl.RunConfig.train_files = ['{data}/long.parquet']",
                                   "polyrl.RolloutConfig.overlong_prompt = 'drop'",
                                   "polyrl.RunConfig.prompts_per_step = 8",
                                   "polyrl.RunConfig.mini_batch_prompts = 8"],
     "every one of the 32 training prompts (RunConfig.train_files=['{data}/long.parquet']) is over "
     "RolloutConfig.max_prompt_len=32 tokens, and RolloutConfig.overlong_prompt='drop' leaves none "
     "to train on: raise RolloutConfig.max_prompt_len (the longest prompt is 70 tokens)"),
    # the model's positions (issue 34: vLLM refused max_model_len 1024 > 256 after start-up)
    ("longer-than-the-model", GRPO, ["polyrl.RolloutConfig.max_model_len = 1024"],
     "RolloutConfig.max_model_len=1024 is longer than the model's max_position_embeddings=256 "
     "({model}/config.json): vLLM would refuse to start; set RolloutConfig.max_model_len = 256"),
    ("prompt-and-response-longer-than-the-model", GRPO,
     ["polyrl.RolloutConfig.max_model_len = 1024", "polyrl.SamplingSpec.max_tokens = 240"],
     "RolloutConfig.max_prompt_len (32) + SamplingSpec.max_tokens (240) = 272 do not fit either: "
     "set RolloutConfig.max_model_len = 256 and RolloutConfig.max_prompt_len = 16"),
    # on CPU every prefill runs whole: the step budget must hold a sequence (issue 46)
    ("cpu-step-budget-below-a-sequence", GRPO, ["polyrl.RolloutConfig.max_num_batched_tokens = 32"],
     "RolloutConfig.max_num_batched_tokens=32 is below RolloutConfig.max_model_len=64: on CPU "
     "every prefill runs whole in one engine step"),
    ("broken-jsonl", GRPO, ["polyrl.RunConfig.train_files = ['{data}/broken.jsonl']"],
     "broken.jsonl: line 3: invalid JSON"),
    # multi-turn episodes (docs/agents.md)
    ("env-task-without-episodes", GRPO, ["polyrl.RunConfig.task = 'guess'"],
     "RunConfig.task: task guess (train): data_source 'polyrl/guess' has no reward function"),
    ("reward-task-as-episodes", MULTITURN, ["polyrl.RunConfig.task = 'copy'"],
     "data_source 'polyrl/copy' has no environment (['openai/gsm8k', 'polyrl/calc', 'polyrl/guess'"),
    ("episode-longer-than-model-len", MULTITURN, ["polyrl.EpisodeConfig.max_episode_tokens = 100"],
     "EpisodeConfig.max_episode_tokens=100 is more than RolloutConfig.max_model_len=80"),
    ("turn-as-long-as-episode", MULTITURN, ["polyrl.SamplingSpec.max_tokens = 64"],
     "SamplingSpec.max_tokens=64 (one turn) is not below EpisodeConfig.max_episode_tokens=64"),
    ("episode-past-positions", MULTITURN, ["polyrl.EpisodeConfig.max_episode_tokens = 300",
                                           "polyrl.RolloutConfig.max_model_len = 300"],
     "EpisodeConfig.max_episode_tokens=300 is more than the model's max_position_embeddings=256"),
    ("episodes-with-remax", MULTITURN, ["include 'gin/algos/remax.gin'"],
     "RunConfig.algorithm (ReMax's greedy baseline) is not supported with RunConfig.episodes"),
    ("episodes-on-the-sync-engine", MULTITURN, ["polyrl.RolloutConfig.engine = 'sync'"],
     "RolloutConfig.engine='sync': RunConfig.episodes runs every episode's turns in flight "
     "together, which needs the asynchronous engine; set RolloutConfig.engine = 'async' (the "
     "default)"),
    ("engine-auto-went", GRPO, ["polyrl.RolloutConfig.engine = 'auto'"],
     "RolloutConfig.engine='auto' is gone: every run takes the asynchronous engine, which "
     "sampled as fast as the synchronous one (docs/rollout.md 'Engines'); remove the binding, "
     "or bind 'sync' for vllm.LLM"),
    ("max-turns-zero", MULTITURN, ["polyrl.EpisodeConfig.max_turns = 0"],
     "EpisodeConfig.max_turns=0 must be >= 1"),
]  # fmt: skip

# On-policy distillation's teacher (issue 50): bound iff the algorithm reads it, and with
# the student's tokenizer; a mismatch names the field that differs.
CASES += [
    ("distillation-without-teacher", DISTILL, ["teacher/polyrl.RoleConfig.model_path = None"],
     "teacher/polyrl.RoleConfig.model_path is None but algorithm 'distillation' scores the "
     "student's tokens with a teacher"),
    ("teacher-unused", GRPO, ["teacher/polyrl.RoleConfig.model_path = '{model}'"],
     "teacher/polyrl.RoleConfig.model_path='{model}' is set but algorithm 'grpo' reads no "
     "teacher"),
    ("reference-with-a-model-of-its-own", GRPO,
     ["reference/polyrl.RoleConfig.model_path = '{model}'"],
     "reference/polyrl.RoleConfig.model_path='{model}': the reference loads "
     "RunConfig.model_path; unbind it (only the reward_model and teacher roles have "
     "checkpoints of their own)"),
    ("teacher-not-a-model", DISTILL, ["teacher/polyrl.RoleConfig.model_path = '{data}'"],
     "teacher/polyrl.RoleConfig.model_path='{data}' has no config.json"),
    ("teacher-other-vocabulary", DISTILL,
     ["teacher/polyrl.RoleConfig.model_path = '{smaller_vocab}'"],
     "does not tokenize as the student (RunConfig.model_path='{model}')"),
    ("teacher-other-vocabulary-size", DISTILL,
     ["teacher/polyrl.RoleConfig.model_path = '{smaller_vocab}'"],
     "vocabulary size: 58 vs 50"),
    ("teacher-other-eos", DISTILL, ["teacher/polyrl.RoleConfig.model_path = '{other_eos}'"],
     "eos_token: '<|im_end|>' (id 1) vs '<|endoftext|>' (id 0)"),
]  # fmt: skip

# LoRA adapts the actor; an algorithm without one (the reward model trains the critic) got
# a full-weight model with no word about the binding.
CASES += [
    ("lora-without-an-actor", RM, ["polyrl.RunConfig.lora = @polyrl.LoraConfig()"],
     "RunConfig.lora=LoraConfig(rank=8, alpha=16.0, dropout=0.0, target_modules=('q_proj', "
     "'k_proj', 'v_proj', 'o_proj')) is set but algorithm 'reward_model' trains no actor: "
     "LoRA adapts the actor only and its critic (the reward model) trains every weight; "
     "unbind it (polyrl.RunConfig.lora = None) to train the critic in full"),
]  # fmt: skip

GIN_FILES = {
    "unclosed.gin": "include 'gin/experiments/tiny_grpo.gin'\npolyrl.RunConfig.total_steps = (3\n",
    "noequals.gin": "include 'gin/experiments/tiny_grpo.gin'\npolyrl.RunConfig.total_steps 3\n",
    "unquoted.gin": "include 'gin/experiments/tiny_grpo.gin'\npolyrl.RunConfig.run_dir = runs/mine\n",
    "badinclude.gin": "include 'gin/base.gin'\ninclude 'gin/algos/grpoo.gin'\n",
    "norundir.gin": "include 'gin/base.gin'\ninclude 'gin/backends/torch_fsdp.gin'\n"
    "include 'gin/algos/grpo.gin'\n",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_model_dir):
    """Data files and gin files the cases name; every case shares one tiny model."""
    data = tmp_path_factory.mktemp("data")
    write_dataset(make_rows("copy", 64), data / "copy.parquet")
    write_dataset(make_rows("copy", 8), data / "eight.parquet")
    mystery = make_rows("copy", 32)
    mystery[0]["data_source"] = "mystery/task"
    write_dataset(mystery, data / "mystery.parquet")
    long = make_rows("copy", 32)
    for row in long:
        row["prompt"][0]["content"] = "copy " + "1234567890" * 6
    write_dataset(long, data / "long.parquet")
    lines = [json.dumps(r) for r in make_rows("copy", 32)]
    lines[2] = lines[2][:-5]
    (data / "broken.jsonl").write_text("\n".join(lines) + "\n")
    gin = tmp_path_factory.mktemp("gin")
    for name, text in GIN_FILES.items():
        (gin / name).write_text(text)
    write_dataset(make_preference_rows("copy", 64), data / "pairs.parquet")
    return {
        "data": str(data),
        "gin": str(gin),
        "model": str(tiny_model_dir),
        **_teachers(tmp_path_factory.mktemp("teachers"), tiny_model_dir),
    }


def _teachers(root, model) -> dict[str, str]:
    """Copies of the tiny model whose tokenizers differ from its own: one trained to a
    smaller vocabulary, one whose end-of-sequence token is another special token."""
    import shutil

    from polyrl.data.tiny import build_tokenizer

    out = {}
    for name in ("smaller_vocab", "other_eos"):
        shutil.copytree(model, root / name)
        out[name] = str(root / name)
    build_tokenizer(vocab_size=50).save_pretrained(out["smaller_vocab"])
    config = root / "other_eos" / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"eos_token": "<|endoftext|>"}))
    return out


def _fill(text: str, corpus: dict) -> str:
    for key, value in corpus.items():
        text = text.replace("{" + key + "}", value)
    return text


def _run(corpus, gin_file, bindings, capsys):
    fill = lambda s: _fill(s, corpus)  # noqa: E731
    argv = ["validate-config", "--gin_file", fill(gin_file)]
    if gin_file != "{gin}/norundir.gin":
        argv += ["--gin_param", f"polyrl.RunConfig.model_path = {corpus['model']!r}"]
        argv += ["--gin_param", f"polyrl.RunConfig.run_dir = '{corpus['data']}/run'"]
    for b in bindings:
        argv += ["--gin_param", fill(b)]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_config_gets_a_named_error(case, corpus, capsys):
    _, gin_file, bindings, expected = case
    code, out, err = _run(corpus, gin_file, bindings, capsys)
    assert code == 1, out + err
    assert _fill(expected, corpus) in err, err
    assert err.startswith("INVALID") and "Traceback" not in err


# Each pitfall's failing config and its fix: the fix passes and prints what it promised.
FIXES = [
    ("role isolation", GRPO,
     ["polyrl.RunConfig.algo_overrides = {'use_kl_loss': True, 'kl_loss_coef': 0.01}"],
     "roles: actor, rollout, reference, reward"),
    ("batch arithmetic", GRPO, ["polyrl.RunConfig.prompts_per_step = 16"],
     "optimizer: 16 / mini_batch_prompts 8 = 2 mini-batch(es) x epochs 1 = 2 updates a step"),
    ("placement", GRPO, ["polyrl.RolloutConfig.tensor_parallel_size = 1"],
     "actor: 64 samples / dp 1 = 64 per rank = 1 micro-batch(es) of <= 64"),
    ("datasets: drop", GRPO, ["polyrl.RunConfig.train_files = ['{data}/copy.parquet', "
                              "'{data}/long.parquet']",
                              "polyrl.RolloutConfig.overlong_prompt = 'drop'"],
     "WARNING RunConfig.train_files: {data}/long.parquet: 32 of 32 prompts are over the prompt "
     "limit (32 tokens) and will be dropped"),
    ("multi-turn", MULTITURN, [], "roles: actor, rollout, reference"),
    ("the engine", GRPO, [],
     "rollout: 1 server(s) x tensor_parallel 1, vLLM's asynchronous engine "
     "(RolloutConfig.engine='async')\n"),
    ("rollout limits", GRPO, [],
     "rollout limits: max_num_seqs as vllm.LLM, max_num_batched_tokens as vllm.LLM, the same "
     "for both engines"),
    ("rollout limits, bound", GRPO, ["polyrl.RolloutConfig.max_num_seqs = 512"],
     "rollout limits: max_num_seqs 512, max_num_batched_tokens as vllm.LLM,"),
    ("synchronous engine, bound", GRPO, ["polyrl.RolloutConfig.engine = 'sync'"],
     "rollout: 1 server(s) x tensor_parallel 1, vLLM's synchronous engine "
     "(RolloutConfig.engine='sync')\n"),
    ("datasets: preference file for DPO", DPO,
     ["polyrl.RunConfig.train_files = ['{data}/pairs.parquet']"],
     "data: total_steps 20 x prompts_per_step 32 = 640 prompts over 64 rows = 10.00 passes"),
    ("distillation teacher", DISTILL, ["teacher/polyrl.RoleConfig.model_path = '{model}'"],
     "roles: actor, rollout, teacher, reward"),
]  # fmt: skip


@pytest.mark.parametrize("fix", FIXES, ids=[f[0] for f in FIXES])
def test_each_pitfall_fix_passes(fix, corpus, capsys):
    _, gin_file, bindings, expected = fix
    code, out, err = _run(corpus, gin_file, bindings, capsys)
    assert code == 0, err
    assert out.startswith("OK ") and _fill(expected, corpus) in out, out


def test_ray_address_where_nothing_listens(corpus, monkeypatch, capsys):
    """Before: OK here, then `polyrl train` failed 35-40 s later with a traceback."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    code, _, err = _run(corpus, GRPO, [], capsys)
    assert code == 1
    assert f"RAY_ADDRESS='127.0.0.1:{port}': cannot connect to 127.0.0.1:{port}" in err, err


def test_train_and_sweep_run_the_same_checks_first(corpus, capsys):
    """No worker starts and no traceback: `polyrl train` prints the named problems, and a
    sweep whose swept binding is misspelled (scope or name) fails before any trial."""
    model = f"polyrl.RunConfig.model_path = {corpus['model']!r}"
    run_dir = f"polyrl.RunConfig.run_dir = '{corpus['data']}/train'"
    argv = ["train", "--gin_file", GRPO, "--gin_param", model, "--gin_param", run_dir]
    assert main([*argv, "--gin_param", "polyrl.RunConfig.prompts_per_step = 12"]) == 1
    err = capsys.readouterr().err
    assert "RunConfig.prompts_per_step=12 is not a multiple of" in err and "Traceback" not in err
    space = "polyrl.SweepConfig.space = {'actr/polyrl.OptimConfig.lr': {'grid': [1e-3, 3e-3]}}"
    sweep = ["sweep", "--gin_file", "gin/sweeps/tiny_grpo_lr.gin", "--gin_param", model]
    assert main([*sweep, "--gin_param", run_dir, "--gin_param", space]) == 1
    err = capsys.readouterr().err
    assert "SweepConfig: swept binding 'actr/polyrl.OptimConfig.lr'" in err, err
    assert "did you mean scope 'actor'?" in err


def test_reward_functions_are_called_on_a_few_rows_first(corpus, tmp_path, monkeypatch, capsys):
    """Issue 34: a reward returning the wrong type was found after the full start-up (78 s),
    inside a traceback. Each configured data_source's reward now runs on a few rows (the
    ground truth as the response, and an empty response) before any worker starts."""
    from polyrl.rewards import REWARDS

    def as_text(response, ground_truth, extra_info=None):
        return "1.0" if response.strip() == ground_truth else "0.0"

    def first_word(response, ground_truth, extra_info=None):
        return float(response.split()[0] == ground_truth)  # IndexError on ""

    monkeypatch.setitem(REWARDS, "test/as_text", as_text)
    monkeypatch.setitem(REWARDS, "test/first_word", first_word)
    rows = make_rows("copy", 64)
    for i, row in enumerate(rows):
        row["data_source"] = "test/as_text" if i % 2 else "test/first_word"
    path = write_dataset(rows, tmp_path / "mine.parquet")
    code, _, err = _run(corpus, GRPO, [f"polyrl.RunConfig.train_files = [{str(path)!r}]"], capsys)
    assert code == 1 and "Traceback" not in err
    truth = rows[1]["ground_truth"]
    assert (
        f"RunConfig.train_files: {path}: row 1 scored with the ground truth as the response: "
        f"reward for data_source 'test/as_text', sample 1 (response {truth!r}) returned '1.0', "
        f"which is a str, not a float; " in err
    ), err
    assert ".as_text must return one finite float per response" in err
    assert (
        f"RunConfig.train_files: {path}: row 0 scored with an empty response: reward for "
        f"data_source 'test/first_word', sample 0 (response '') raised IndexError: list index "
        f"out of range; fix " in err
    ), err
    assert err.count("test/as_text") == 1 and err.count("test/first_word") == 1  # once each


@pytest.mark.parametrize("mode", ["local", "cluster"])
def test_ray_address_of_another_service(corpus, monkeypatch, capfd, mode):
    """Issue 34: RAY_ADDRESS at a port where an HTTP server listens: ray.init retried for
    minutes, printing Ray's gcs_client/rpc_client lines (9 in 120 s, then killed) before
    any message of polyrl's. Now a gRPC probe names it at once, and Ray never starts."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # the server's own request log is not under test
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    argv = ["validate-config", "--gin_file", GRPO, "--mode", mode]
    argv += ["--gin_param", f"polyrl.RunConfig.model_path = {corpus['model']!r}"]
    argv += ["--gin_param", f"polyrl.RunConfig.run_dir = '{corpus['data']}/run'"]
    try:
        assert main(argv) == 1
    finally:
        server.shutdown()
    err = capfd.readouterr().err
    assert (
        f"ERROR RAY_ADDRESS='127.0.0.1:{port}': something listens at 127.0.0.1:{port} but it "
        f"is not a Ray head (no gRPC answer within 3 s); point RAY_ADDRESS at the head's GCS "
        f"port" in err
    ), err
    assert "gcs_client" not in err and "rpc_client" not in err and len(err.splitlines()) == 2


def _suggested_bindings(err: str) -> list[str]:
    """The bindings validate-config's fixes tell the user to write (``NAME = VALUE``
    after "write it ...:") and the values it says to set (``set NAME = VALUE``, or
    ``set NAME <= VALUE`` taken as that value)."""
    import re

    found = re.findall(r"(?:write it (?:without quotes|as): |set )([\w./]+) <?= ([^\s,;)]+)", err)
    return [f"{name} = {value}" for name, value in found]


@pytest.mark.parametrize(
    "bindings",
    [
        ["polyrl.SamplingSpec.max_tokens = '16'"],  # issue 47: it said 16.0, then refused it
        ["actor/polyrl.OptimConfig.lr = '3e-3'"],
        ["polyrl.SamplingSpec.max_tokens = 16.0"],
        # issue 47: "set RolloutConfig.max_prompt_len <= -20"
        ["polyrl.RolloutConfig.max_model_len = 44", "polyrl.SamplingSpec.max_tokens = 64"],
        ["polyrl.RolloutConfig.max_model_len = 44", "polyrl.SamplingSpec.max_tokens = 20"],
    ],
)
def test_every_suggested_value_is_valid(bindings, corpus, capsys):
    """Each value a fix suggests has the field's type and range: the config with it
    applied gets past that problem (issue 47: `64.0` for an int field, a negative limit)."""
    import re

    code, _, err = _run(corpus, GRPO, bindings, capsys)
    assert code == 1, err
    suggested = _suggested_bindings(err)
    assert suggested, err
    assert not re.search(r"<= -\d|= -\d", err), err
    for fix in suggested:
        name = fix.split(" = ")[0]
        full = fix if name.startswith(("polyrl.", "actor/")) else f"polyrl.{fix}"
        kept = [b for b in bindings if b.split(" = ")[0] != full.split(" = ")[0]]
        code, out, err2 = _run(corpus, GRPO, [*kept, full], capsys)
        assert code == 0, f"{fix} (suggested by {err}) still fails: {err2}"


def test_a_range_error_names_the_bad_field_only(corpus, capsys):
    # issue 47: "EpisodeConfig.max_tool_calls=-1 and EpisodeConfig.env_workers=1 must be >= 0"
    code, _, err = _run(corpus, MULTITURN, ["polyrl.EpisodeConfig.max_tool_calls = -1"], capsys)
    assert code == 1
    assert "EpisodeConfig.max_tool_calls=-1 must be >= 0" in err, err
    assert "env_workers" not in err, err


def test_every_constructor_error_in_one_run(corpus, capsys):
    """issue 47: validate-config stopped at the first field a config's __post_init__
    refused; each of these was reported only once the one before it was fixed."""
    bad = {
        "polyrl.LoraConfig.rank = 0": "LoraConfig.rank=0 must be >= 1",
        "polyrl.LoraConfig.alpha = -1.0": "LoraConfig.alpha=-1.0 must be > 0",
        "polyrl.LoraConfig.target_modules = ['q_prj']": "LoraConfig.target_modules has 'q_prj'",
        "actor/polyrl.OptimConfig.lr = -1.0": "actor/polyrl.OptimConfig: OptimConfig.lr=-1.0",
        "actor/polyrl.OptimConfig.warmup_steps = -2": "OptimConfig.warmup_steps=-2 must be >= 0",
        # the same message in another scope is a problem of its own
        "critic/polyrl.OptimConfig.lr = -1.0": "critic/polyrl.OptimConfig: OptimConfig.lr=-1.0",
        "actor/polyrl.ParallelConfig.micro_batch_size = 0": "micro_batch_size=0 must be >= 1",
        "actor/polyrl.ParallelConfig.logits_chunk_tokens = 0": "logits_chunk_tokens=0 must be",
        "polyrl.SamplingSpec.n = 0": "SamplingSpec.n=0 must be >= 1",
        "polyrl.SamplingSpec.temperature = -1.0": "SamplingSpec.temperature=-1.0 must be >= 0",
        "polyrl.RolloutConfig.overlong_prompt = 'dorp'": "overlong_prompt='dorp' is not one of",
        "polyrl.RolloutConfig.num_servers = 0": "RolloutConfig.num_servers=0 must be >= 1",
        "polyrl.EpisodeConfig.max_turns = 0": "EpisodeConfig.max_turns=0 must be >= 1",
        "polyrl.EpisodeConfig.env_workers = -1": "EpisodeConfig.env_workers=-1 must be >= 0",
    }
    code, _, err = _run(
        corpus, MULTITURN, [*bad, "polyrl.RunConfig.lora = @polyrl.LoraConfig()"], capsys
    )
    assert code == 1
    missing = [want for want in bad.values() if want not in err]
    assert not missing, f"not reported: {missing}\n{err}"
    assert err.startswith(f"INVALID {MULTITURN}: {len(bad)} problem(s)"), err  # each once
