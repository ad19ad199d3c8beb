"""Reading and writing prompt datasets: files, shard directories, Hugging Face folders,
and verl's parquet schema next to polyrl's own.

Where rows come from (``read_dataset(path)``):

* a ``.parquet`` or ``.jsonl`` file;
* a directory of ``.parquet``/``.jsonl`` shards, read in file-name order;
* a Hugging Face ``datasets`` folder written by ``Dataset.save_to_disk`` (a
  ``DatasetDict`` folder holds one such folder per split: point at the split).

Row schemas (both load unchanged; docs/datasets.md shows the mapping):

* polyrl: ``prompt``, ``ground_truth``, ``data_source``, ``extra_info`` (optional);
* verl: ``prompt``, ``data_source``, ``reward_model`` (``{"style": "rule",
  "ground_truth": ...}``), ``ability``, ``extra_info``. The ground truth is read from
  ``reward_model.ground_truth`` into ``ground_truth``; every other field is kept as is.
  A number as ground truth (verl's MATH and GSM8K files hold strings; some user files
  hold ints) becomes its decimal string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["read_dataset", "write_dataset", "dataset_files", "from_verl", "row_schema", "SUFFIXES"]

SUFFIXES = (".parquet", ".jsonl")
# Files ``Dataset.save_to_disk`` writes beside its .arrow shards.
HF_MARKERS = ("state.json", "dataset_info.json")


def write_dataset(rows: list[dict], path: str | Path) -> Path:
    """Write rows as ``.parquet`` or ``.jsonl`` (by suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise ValueError(f"dataset path {str(path)!r}: suffix must be one of {list(SUFFIXES)}")
    return path


def dataset_files(path: str | Path) -> list[Path]:
    """The shard files a directory dataset reads, in order (a file: itself)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(
                f"dataset path {str(path)!r}: suffix must be one of {list(SUFFIXES)}, or pass a "
                f"directory of shards or a Hugging Face save_to_disk folder"
            )
        return [path]
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(
            f"dataset {str(path)!r} is a Hugging Face DatasetDict with splits {splits}; "
            f"point at one split's folder, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    shards = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES)
    if not shards:
        raise ValueError(
            f"dataset directory {str(path)!r} has no .parquet/.jsonl shards and is not a "
            f"Hugging Face save_to_disk folder (no {' / '.join(HF_MARKERS)})"
        )
    return shards


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and all((path / name).exists() for name in HF_MARKERS)


def read_dataset(path: str | Path) -> list[dict]:
    """Rows of a dataset file, shard directory or Hugging Face folder, in polyrl's schema
    (verl rows get ``ground_truth`` from ``reward_model.ground_truth``); not validated
    (see polyrl.data.schema)."""
    path = Path(path)
    if _is_hf_folder(path):
        import datasets

        rows = datasets.load_from_disk(str(path)).to_list()
    else:
        rows = [row for f in dataset_files(path) for row in _read_file(f)]
    return [from_verl(row) for row in rows]


def from_verl(row: Any) -> Any:
    """A verl row with ``ground_truth`` copied up from ``reward_model.ground_truth`` (a
    top-level ``ground_truth`` wins); other rows unchanged."""
    if not isinstance(row, Mapping) or "ground_truth" in row:
        return row
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
        return row
    truth = reward_model["ground_truth"]
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    return {**row, "ground_truth": truth}


def row_schema(row: Any) -> str:
    """ "verl" when a row carries its ground truth in ``reward_model``, else "polyrl"."""
    return "verl" if isinstance(row, Mapping) and "reward_model" in row else "polyrl"
