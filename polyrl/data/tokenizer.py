"""A model directory's tokenizer as ``AutoTokenizer.from_pretrained`` loads it, without
``AutoTokenizer``'s imports on the way once the class is known (issue 48).

``from transformers import AutoTokenizer`` imports torch (through the configuration
classes): 2.5 s of a driver's 2.9 s of checks on the 2-core machine, where the tokenizer's
own class (e.g. ``Qwen2Tokenizer``) imports in 0.9 s without torch. Which class
``AutoTokenizer`` picks depends on the directory's ``tokenizer_config.json`` and
``config.json``, its path and the transformers version; the class it picked for them is
kept in ``RunConfig.cache_dir`` and loaded directly the next time, with the same
``from_pretrained`` call. Remote code (a class outside transformers) is never kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

__all__ = ["load_tokenizer"]

_CONFIGS = ("tokenizer_config.json", "config.json")


def load_tokenizer(path: str | Path, cache_dir: str | Path | None = None) -> Any:
    """``AutoTokenizer.from_pretrained(path)``; with ``cache_dir``, the class it picked
    for this directory is remembered there and loaded directly next time. Raises what
    ``from_pretrained`` raises (OSError, ValueError) for a directory without a usable
    tokenizer."""
    kept = _kept_path(path, cache_dir)
    if kept is not None and kept.is_file():
        module, name = json.loads(kept.read_text())["class"].split(":")
        return getattr(importlib.import_module(module), name).from_pretrained(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    cls = type(tokenizer)
    if kept is not None and cls.__module__.startswith("transformers."):
        # (a cache_dir that cannot be written: loaded as now next time; the compile
        # cache in the same directory is what names it)
        with contextlib.suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            part = kept.with_name(f"{kept.name}.{os.getpid()}")
            part.write_text(json.dumps({"class": f"{cls.__module__}:{cls.__qualname__}"}))
            part.replace(kept)  # whole or absent, with runs side by side
    return tokenizer


def _kept_path(path: str | Path, cache_dir: str | Path | None) -> Path | None:
    """Where the class for ``path`` is kept: a name from every input of AutoTokenizer's
    choice (None: no cache_dir (None or ""), or not a local directory)."""
    if not cache_dir or not Path(path).is_dir():
        return None
    key = hashlib.sha256(f"{version('transformers')}\0{path}".encode())
    for name in _CONFIGS:
        config = Path(path, name)
        key.update(b"\0" + (config.read_bytes() if config.is_file() else b"-"))
    return Path(cache_dir).expanduser() / "tokenizer_classes" / f"{key.hexdigest()[:32]}.json"
