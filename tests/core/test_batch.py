"""polyrl.batch: container operations, round trips and bad input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from polyrl.batch import Batch, from_token_lists


def make(n: int = 6) -> Batch:
    return Batch(
        {"x": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "y": np.arange(n)},
        {"text": [f"s{i}" for i in range(n)], "gt": [{"a": i} for i in range(n)]},
        {"step": 7},
    )


def test_columns_must_have_equal_length_and_error_names_column():
    with pytest.raises(ValueError, match=r"column 'y' has 3 samples but column 'x' has 4"):
        Batch({"x": np.zeros((4, 2)), "y": np.zeros(3)})
    with pytest.raises(ValueError, match=r"column 'gt' has 2 samples"):
        Batch({"x": np.zeros((4, 2))}, {"gt": ["a", "b"]})


def test_scalar_column_rejected_with_hint():
    with pytest.raises(ValueError, match=r"'t'.*Batch.info"):
        Batch({"t": np.float32(1.0)})


def test_meta_keeps_nested_objects_per_sample():
    b = Batch(
        meta={"prompt": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]}
    )
    assert len(b) == 2
    assert b["prompt"][1][0]["content"] == "yo"


def test_split_concat_round_trip():
    b = make(6)
    parts = b.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["text"].tolist() == ["s2", "s3"]
    back = Batch.concat(parts)
    np.testing.assert_array_equal(back["x"], b["x"])
    assert back["gt"].tolist() == b["gt"].tolist()
    assert back.info == {"step": 7}


def test_split_uneven_error_suggests_padding():
    with pytest.raises(ValueError, match=r"5 samples do not split into 2.*pad_to_multiple\(2\)"):
        make(5).split(2)


def test_chunks_cover_all_rows_in_order():
    chunks = make(5).chunks(2)
    assert [len(c) for c in chunks] == [2, 2, 1]
    assert np.concatenate([c["y"] for c in chunks]).tolist() == [0, 1, 2, 3, 4]


def test_take_by_mask_and_index():
    b = make(4)
    assert b.take(np.array([True, False, True, False]))["y"].tolist() == [0, 2]
    assert b.take([3, 0])["text"].tolist() == ["s3", "s0"]
    with pytest.raises(ValueError, match="boolean mask has shape"):
        b.take(np.array([True, False]))


def test_repeat_interleaves_and_adds_group_ids():
    b = make(3).repeat(2)
    assert b["y"].tolist() == [0, 0, 1, 1, 2, 2]
    assert b["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert b["text"].tolist() == ["s0", "s0", "s1", "s1", "s2", "s2"]
    # Existing group ids are kept, not renumbered.
    again = b.take([0, 2]).repeat(2)
    assert again["group_ids"].tolist() == [0, 0, 1, 1]


def test_pad_to_multiple_marks_padding_and_keeps_rows():
    b = make(5)
    padded = b.pad_to_multiple(4)
    assert len(padded) == 8
    assert padded["is_pad"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(padded["x"][:5], b["x"])
    np.testing.assert_array_equal(padded["x"][5:], np.repeat(b["x"][4:5], 3, axis=0))
    assert padded["text"].tolist()[:5] == b["text"].tolist()
    assert len(b.pad_to_multiple(5)) == 5


def test_concat_rejects_mismatched_columns_and_shapes():
    with pytest.raises(ValueError, match="batch 1 has columns"):
        Batch.concat([make(2), make(2).select("x")])
    a = Batch({"x": np.zeros((2, 3))})
    with pytest.raises(ValueError, match=r"column 'x' has per-sample shape \(4,\)"):
        Batch.concat([a, Batch({"x": np.zeros((2, 4))})])


def test_require_names_missing_columns():
    with pytest.raises(KeyError, match=r"train_step needs batch column\(s\) \['advantages'\]"):
        make().require("x", "advantages", who="train_step")


def test_pickle_round_trip_keeps_everything():
    b = make(4)
    back = pickle.loads(pickle.dumps(b, protocol=5))
    np.testing.assert_array_equal(back["x"], b["x"])
    assert back["gt"].tolist() == b["gt"].tolist() and back.info == b.info


def test_from_token_lists_layout():
    b = from_token_lists([[5, 6], [7]], [[1, 2, 3], [4]], pad_id=0)
    # P = 2 (left-padded prompts), R = 3 (right-padded responses)
    assert b["prompts"].tolist() == [[5, 6], [0, 7]]
    assert b["responses"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert b["input_ids"].tolist() == [[5, 6, 1, 2, 3], [0, 7, 4, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]
    assert b["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_from_token_lists_fixed_widths_and_overflow_error():
    b = from_token_lists([[5]], [[1]], pad_id=9, prompt_len=3, response_len=2)
    assert b["input_ids"].tolist() == [[9, 9, 5, 1, 9]]
    with pytest.raises(ValueError, match="response_len=1 but the longest sequence has 2"):
        from_token_lists([[5]], [[1, 2]], pad_id=0, response_len=1)
