"""Dataset sources: verl's parquet schema, shard directories, Hugging Face folders."""

from __future__ import annotations

import numpy as np
import pytest

from polyrl.data.formats import read_dataset, write_dataset
from polyrl.data.loader import PromptSource
from polyrl.data.schema import DatasetError, validate_file
from polyrl.data.tasks import make_rows


def _verl(row: dict, i: int) -> dict:
    """The row as verl's examples/data_preprocess scripts write it."""
    return {
        "data_source": row["data_source"],
        "prompt": row["prompt"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
        "extra_info": {"split": "train", "index": i},
    }


def test_verl_parquet_gives_the_same_batches_as_polyrl_schema(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = make_rows("addition", 24, seed=3)
    ours = PromptSource.from_files([str(write_dataset(rows, tmp_path / "ours.parquet"))], tok)
    verl_path = write_dataset([_verl(r, i) for i, r in enumerate(rows)], tmp_path / "verl.parquet")
    theirs = PromptSource.from_files([str(verl_path)], tok)
    for k in range(5):  # 3 batches an epoch: crosses into the second permutation
        a, b = ours.batch(k, 8), theirs.batch(k, 8)
        np.testing.assert_array_equal(a["prompt_index"], b["prompt_index"])
        for col in ("prompt_ids", "ground_truth", "data_source", "extra_info"):
            assert list(a[col]) == list(b[col]), col
    # verl's own fields are kept on the rows
    assert theirs.rows[5]["ability"] == "math"
    assert theirs.rows[5]["reward_model"]["ground_truth"] == rows[5]["ground_truth"]
    report = validate_file(verl_path)
    assert report.schema == "verl" and report.n_rows == 24
    assert "verl schema" in report.summary()


def test_numeric_ground_truth_becomes_a_string(tmp_path):
    row = _verl(make_rows("addition", 1)[0], 0)
    row["reward_model"]["ground_truth"] = 72
    path = write_dataset([row], tmp_path / "d.jsonl")
    assert read_dataset(path)[0]["ground_truth"] == "72"


def test_verl_row_without_ground_truth_names_both_fields(tmp_path):
    row = _verl(make_rows("addition", 1)[0], 0)
    row["reward_model"] = {"style": "rule"}
    path = write_dataset([row], tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"row 0: missing field 'ground_truth'.*reward_model"):
        validate_file(path)


def test_shard_directory_reads_in_name_order(tmp_path):
    rows = make_rows("copy", 10)
    write_dataset(rows[6:], tmp_path / "shards" / "part-001.jsonl")
    write_dataset(rows[:6], tmp_path / "shards" / "part-000.parquet")
    (tmp_path / "shards" / "README.txt").write_text("not a shard")
    assert read_dataset(tmp_path / "shards") == rows
    assert validate_file(tmp_path / "shards").n_rows == 10


def test_hugging_face_folder_and_dataset_dict(tmp_path):
    import datasets

    rows = make_rows("addition", 7)
    verl_rows = [_verl(r, i) for i, r in enumerate(rows)]
    ds = datasets.Dataset.from_list(verl_rows)
    ds.save_to_disk(str(tmp_path / "hf"))
    loaded = read_dataset(tmp_path / "hf")
    assert [r["ground_truth"] for r in loaded] == [r["ground_truth"] for r in rows]
    assert [r["prompt"] for r in loaded] == [r["prompt"] for r in rows]
    assert validate_file(tmp_path / "hf").schema == "verl"
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits.*dd/train"):
        read_dataset(tmp_path / "dd")
    assert len(read_dataset(tmp_path / "dd" / "test")) == 7


def test_bad_paths_say_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_dataset(tmp_path / "missing.parquet")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"suffix must be one of.*directory of shards"):
        read_dataset(tmp_path / "d.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .parquet/.jsonl shards"):
        read_dataset(tmp_path / "empty")
