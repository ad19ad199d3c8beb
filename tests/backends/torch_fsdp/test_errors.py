"""Bad input fails early with a message naming the field/value and the fix."""

from __future__ import annotations

import shutil

import pytest
from torch_fsdp_helpers import actor, nll_loss, random_batch

from polyrl.backends import get_engine
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

_ADAMW, _ONE_RANK = OptimConfig(), ParallelConfig()


def _init(path, role="actor", optim=_ADAMW, parallel=_ONE_RANK, **kw):
    engine = get_engine("torch_fsdp")()
    engine.init(ModelConfig(str(path), role=role, **kw), optim, parallel)
    return engine


def test_wrong_model_path(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"ModelConfig.path='.*nope' does not exist.*Hugging Face"
    ):
        _init(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        _init(tmp_path)


def test_missing_tokenizer(tiny_model_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.*tokenizer.save_pretrained"):
        _init(tmp_path)


def test_missing_batch_column(tiny_model_dir):
    engine = actor(tiny_model_dir)
    batch = random_batch(2).select("input_ids", "attention_mask", "responses", "response_mask")
    with pytest.raises(
        KeyError, match=r"TorchFSDPEngine.forward needs batch column\(s\) \['position_ids'\]"
    ):
        engine.forward(batch)
    with pytest.raises(KeyError, match=r"train_step needs batch column\(s\) \['position_ids'\]"):
        engine.train_step(batch, nll_loss)


def test_optimizer_must_match_role(tiny_model_dir):
    with pytest.raises(ValueError, match=r"role='reference' is frozen.*pass optim=None"):
        _init(tiny_model_dir, role="reference")
    with pytest.raises(ValueError, match=r"role='critic' trains, but optim is None"):
        _init(tiny_model_dir, role="critic", optim=None)


def test_mesh_must_fit_the_world(tiny_model_dir):
    with pytest.raises(ValueError, match=r"fsdp=2.*= 2 devices, but 1 are available"):
        _init(tiny_model_dir, parallel=ParallelConfig(mesh={"fsdp": 2}))
    with pytest.raises(ValueError, match=r"tensor=2.*= 2 devices, but 1 are available"):
        _init(tiny_model_dir, parallel=ParallelConfig(mesh={"tensor": 2}))


def test_tensor_parallel_rules_must_split_heads_and_mlp(tiny_model_dir):
    rules = (("batch", ("data", "fsdp")), ("mlp", ()))
    with pytest.raises(
        ValueError,
        match=r"rules maps 'mlp' to \(\); with mesh tensor=2 .*use \('mlp', \('tensor',\)\)",
    ):
        _init(tiny_model_dir, parallel=ParallelConfig(mesh={"tensor": 2}, rules=rules))


def test_tensor_axis_must_split_the_heads(tiny_model_dir):
    """The tiny model has 4 query heads, 2 key/value heads and an MLP width of 256."""
    with pytest.raises(
        ValueError,
        match=r"^actor/ParallelConfig.mesh tensor=3: the model's num_attention_heads=4, "
        r"num_key_value_heads=2, intermediate_size=256 does not split over 3 tensor-parallel "
        r"ranks; set tensor to one of \[1, 2\]",
    ):
        _init(tiny_model_dir, parallel=ParallelConfig(mesh={"tensor": 3}))
    with pytest.raises(
        ValueError,
        match=r"^critic/ParallelConfig.mesh tensor=4: the model's "
        r"num_key_value_heads=2 does not split",
    ):
        _init(tiny_model_dir, role="critic", parallel=ParallelConfig(mesh={"tensor": 4}))


def test_compile_refuses_tensor_parallelism(tiny_model_dir):
    """Inductor fails on the tensor-parallel layers: refused before any weight is read."""
    with pytest.raises(
        ValueError,
        match=r"^actor/ParallelConfig.mesh tensor=2 with ModelConfig.compile=True .*set "
        r"compile=False, or tensor=1",
    ):
        _init(tiny_model_dir, compile=True, parallel=ParallelConfig(mesh={"tensor": 2}))


def test_value_head_path_without_a_head(tiny_model_dir):
    with pytest.raises(ValueError, match=r"value_head_path=.* has no scalar head.*score.weight"):
        _init(tiny_model_dir, role="critic", value_head_path=str(tiny_model_dir))


def test_load_rejects_an_incomplete_checkpoint(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete torch_fsdp checkpoint"):
        actor(tiny_model_dir).load(str(tmp_path))


def test_temperature_must_be_positive(tiny_model_dir):
    with pytest.raises(ValueError, match=r"temperature=0.0 must be > 0"):
        actor(tiny_model_dir).forward(random_batch(2), temperature=0.0)
