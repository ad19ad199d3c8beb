"""polyrl.data.tokenizer: AutoTokenizer's choice of class kept, and loaded without torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from polyrl.configure.launch import parse_config
from polyrl.configure.validate import ConfigError, preflight
from polyrl.data.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "copy: a b c"}]


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert (a.eos_token_id, a.pad_token_id, a.padding_side) == (
        b.eos_token_id,
        b.pad_token_id,
        b.padding_side,
    )
    assert a.apply_chat_template(CHAT, add_generation_prompt=True) == b.apply_chat_template(
        CHAT, add_generation_prompt=True
    )
    assert a("a b c d")["input_ids"] == b("a b c d")["input_ids"]


def test_kept_class_loads_the_same_tokenizer_without_torch(tiny_model_dir, tmp_path):
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = load_tokenizer(tiny_model_dir, tmp_path)  # AutoTokenizer's, its class kept
    (kept,) = (tmp_path / "tokenizer_classes").iterdir()
    assert json.loads(kept.read_text()) == {
        "class": "transformers.models.qwen2.tokenization_qwen2:Qwen2Tokenizer"
    }
    _same(first, auto)
    _same(load_tokenizer(tiny_model_dir, tmp_path), auto)
    # A fresh process loads it through the kept class: torch is never imported.
    code = (
        "import json, sys; from polyrl.data.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tiny_model_dir)!r}, {str(tmp_path)!r}); "
        f"print(json.dumps([type(t).__name__, t.apply_chat_template({CHAT!r}, "
        "add_generation_prompt=True)['input_ids'], 'torch' in sys.modules, "
        "'transformers.models.auto.tokenization_auto' in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    name, ids, torch_imported, auto_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == "Qwen2Tokenizer"
    assert ids == auto.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert not torch_imported and not auto_imported


def test_a_changed_config_is_not_loaded_by_the_kept_class(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    assert load_tokenizer(model, tmp_path).padding_side == "left"
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"padding_side": "right"}))
    assert load_tokenizer(model, tmp_path).padding_side == "right"
    assert len(list((tmp_path / "tokenizer_classes").iterdir())) == 2  # a key of its own


def test_a_cache_dir_that_cannot_be_written_still_loads(tiny_model_dir, tmp_path):
    (tmp_path / "tokenizer_classes").write_text("a file, not a directory")
    assert type(load_tokenizer(tiny_model_dir, tmp_path)).__name__ == "Qwen2Tokenizer"


def test_no_cache_dir_keeps_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cache_dir in (None, ""):
        assert type(load_tokenizer(tiny_model_dir, cache_dir)).__name__ == "Qwen2Tokenizer"
    assert list(tmp_path.iterdir()) == []


def test_checks_name_a_damaged_tokenizer_with_its_class_kept(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    params = [
        f"polyrl.RunConfig.run_dir = {str(tmp_path / 'run')!r}",
        f"polyrl.RunConfig.model_path = {str(model)!r}",
        f"polyrl.RunConfig.cache_dir = {str(tmp_path / 'cache')!r}",
    ]
    cfg, _ = parse_config(["gin/experiments/tiny_grpo.gin"], params)
    preflight(cfg)  # keeps the class
    assert list((tmp_path / "cache" / "tokenizer_classes").iterdir())
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"RunConfig.model_path=.*its tokenizer cannot be loaded"):
        preflight(cfg)
