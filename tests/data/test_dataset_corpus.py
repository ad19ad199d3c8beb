"""validate-dataset on a corpus of malformed datasets, each made by corrupting the
project's own valid task data (polyrl.data.tasks): every one exits non-zero with a
message naming the row (and jsonl line), the field and the fix; no file is modified."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.data.formats import write_dataset
from polyrl.data.tasks import make_preference_rows, make_rows


def _rl(n: int = 6) -> list[dict]:
    return make_rows("copy", n)


def _pairs(n: int = 6) -> list[dict]:
    return make_preference_rows("copy", n)


def _edit(rows: list[dict], i: int, **changes) -> list[dict]:
    for key, value in changes.items():
        if value is _DROP:
            rows[i].pop(key)
        else:
            rows[i][key] = value
    return rows


_DROP = object()


def _lines(rows: list) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _raw(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _broken_line(path: Path) -> None:
    lines = _lines(_rl()).split(b"\n")
    lines[2] = lines[2][:-7]
    _raw(path, b"\n".join(lines))


def _non_utf8(path: Path) -> None:
    lines = _lines(_rl()).split(b"\n")
    lines[4] = lines[4].replace(b"copy", b"c\xffpy")
    _raw(path, b"\n".join(lines))


def _corrupt_parquet(path: Path) -> None:
    write_dataset(_rl(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _many(path: Path) -> None:
    rows = _rl()
    rows[1]["prompt"][0]["role"] = "bot"
    rows[3]["data_source"] = "nope"
    rows[5].pop("ground_truth")
    write_dataset(rows, path)


def _system_only(n: int) -> list[dict]:
    rows = _rl()
    rows[n]["prompt"] = [{"role": "system", "content": "be brief"}]
    return rows


def _ends_on_assistant() -> list[dict]:
    rows = _rl()
    rows[2]["prompt"].append({"role": "assistant", "content": "12"})
    return rows


# (id, file name, how to build it, extra CLI args, expected exit code, expected text)
CASES = [
    ("missing-file", "absent.jsonl", None, [], 1, "file '{path}' does not exist"),
    ("broken-jsonl-line", "x.jsonl", _broken_line, [], 1,
     "line 3: invalid JSON (Unterminated string"),
    ("truncated-last-line", "x.jsonl", lambda p: _raw(p, _lines(_rl())[:-9]), [], 1,
     "line 6: invalid JSON"),
    ("non-utf8-bytes", "x.jsonl", _non_utf8, [], 1,
     "line 5: not UTF-8 (byte 0xff at column"),
    ("utf8-bom", "x.jsonl", lambda p: _raw(p, b"\xef\xbb\xbf" + _lines(_rl())), [], 1,
     "line 1: invalid JSON"),
    ("empty-file", "x.jsonl", lambda p: _raw(p, b""), [], 1, "the dataset has no rows"),
    ("blank-lines-only", "x.jsonl", lambda p: _raw(p, b"\n\n  \n"), [], 1,
     "the dataset has no rows"),
    ("corrupt-parquet", "x.parquet", _corrupt_parquet, [], 1, "cannot be parsed: "),
    ("wrong-suffix", "x.csv", lambda p: _raw(p, b"prompt,ground_truth\n"), [], 1,
     "suffix must be one of ['.parquet', '.jsonl']"),
    ("empty-directory", "shards", lambda p: p.mkdir(), [], 1,
     "has no .parquet/.jsonl shards"),
    ("row-not-object", "x.jsonl", lambda p: _raw(p, _lines([*_rl(2), [1, 2]])), [], 1,
     "row 2 (line 3): expected an object with fields"),
    ("missing-prompt", "x.jsonl", lambda p: _raw(p, _lines(_edit(_rl(), 1, prompt=_DROP))), [], 1,
     "row 1 (line 2): missing field 'prompt'"),
    ("missing-ground-truth", "x.parquet",
     lambda p: write_dataset(_edit(_rl(), 0, ground_truth=_DROP), p), [], 1,
     # (the parquet writer takes its columns from the first row: every row lacks it, one line)
     "6 rows (row 0, row 1, row 2, ...): missing field 'ground_truth' (required fields: "
     "['prompt', 'ground_truth', 'data_source']) or verl's 'reward_model'"),
    ("missing-data-source", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_rl(), 3, data_source=_DROP))), [], 1,
     "row 3 (line 4): missing field 'data_source'"),
    ("prompt-is-string", "x.jsonl", lambda p: _raw(p, _lines(_edit(_rl(), 0, prompt="hi"))), [],
     1, "row 0 (line 1): field 'prompt' must be a non-empty list of chat messages"),
    ("prompt-empty-list", "x.jsonl", lambda p: _raw(p, _lines(_edit(_rl(), 0, prompt=[]))), [], 1,
     "field 'prompt' must be a non-empty list"),
    ("message-not-object", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_rl(), 0, prompt=["copy 123"]))), [], 1,
     "row 0 (line 1): prompt[0].role=None is not one of"),
    ("bad-role", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_rl(), 4, prompt=[{"role": "bot", "content": "x"}]))), [], 1,
     "row 4 (line 5): prompt[0].role='bot' is not one of ['system', 'user', 'assistant']"),
    ("empty-content", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_rl(), 0, prompt=[{"role": "user", "content": ""}]))), [], 1,
     "prompt[0].content must be a non-empty string"),
    ("content-not-string", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_rl(), 0, prompt=[{"role": "user", "content": 7}]))), [], 1,
     "prompt[0].content must be a non-empty string, got 7"),
    ("system-only-prompt", "x.jsonl", lambda p: _raw(p, _lines(_system_only(1))), [], 1,
     "row 1 (line 2): prompt has only system message(s); add a user turn"),
    ("ends-on-assistant", "x.parquet", lambda p: write_dataset(_ends_on_assistant(), p), [], 1,
     "row 2: prompt ends on an assistant turn (prompt[1])"),
    ("ground-truth-int", "x.jsonl", lambda p: _raw(p, _lines(_edit(_rl(), 2, ground_truth=7))),
     [], 1, "row 2 (line 3): field 'ground_truth' must be a string, got int 7"),
    ("data-source-null", "x.jsonl", lambda p: _raw(p, _lines(_edit(_rl(), 2, data_source=None))),
     [], 1, "row 2 (line 3): missing field 'data_source'"),
    ("unregistered-data-source", "x.parquet",
     lambda p: write_dataset(_edit(_rl(), 5, data_source="mystery"), p), [], 1,
     "row 5: data_source='mystery' has no reward function"),
    ("extra-info-string", "x.jsonl", lambda p: _raw(p, _lines(_edit(_rl(), 0, extra_info="x"))),
     [], 1, "field 'extra_info' must be an object or absent"),
    ("verl-without-ground-truth", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_rl(), 0, ground_truth=_DROP,
                                    reward_model={"style": "rule"}))), [], 1,
     "row 0 (line 1): missing field 'ground_truth'"),
    ("many-problems-all-reported", "x.parquet", _many, [], 1,
     "row 1: prompt[0].role='bot'|row 3: data_source='nope'|row 5: missing field 'ground_truth'"),
    # preference pairs
    ("chosen-missing-everywhere", "x.jsonl",
     lambda p: _raw(p, _lines([{k: v for k, v in r.items() if k != "chosen"} for r in _pairs()])),
     [], 1, "6 rows (row 0 (line 1), row 1 (line 2), row 2 (line 3), ...): missing field "
     "'chosen' (required fields: ['prompt', 'chosen', 'rejected'])"),
    ("chosen-missing-in-one-row", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_pairs(), 3, chosen=_DROP))), [], 1,
     "row 3 (line 4): missing field 'chosen'"),
    ("chosen-missing-first-row", "x.parquet",
     lambda p: write_dataset(_edit(_pairs(), 0, chosen=None), p), [], 1,
     "row 0: missing field 'chosen'"),
    ("rejected-missing", "x.jsonl", lambda p: _raw(p, _lines(_edit(_pairs(), 1, rejected=_DROP))),
     [], 1, "row 1 (line 2): missing field 'rejected'"),
    ("chosen-empty", "x.jsonl", lambda p: _raw(p, _lines(_edit(_pairs(), 2, chosen=""))), [], 1,
     "row 2 (line 3): field 'chosen' is empty"),
    ("rejected-blank", "x.jsonl", lambda p: _raw(p, _lines(_edit(_pairs(), 2, rejected="  "))),
     [], 1, "row 2 (line 3): field 'rejected' is empty"),
    ("chosen-equals-rejected", "x.jsonl",
     lambda p: _raw(p, _lines(_edit(_pairs(), 4, rejected=_pairs()[4]["chosen"]))), [], 1,
     "row 4 (line 5): 'chosen' and 'rejected' are the same text"),
    ("chosen-not-string", "x.jsonl", lambda p: _raw(p, _lines(_edit(_pairs(), 0, chosen=["a"]))),
     [], 1, "row 0 (line 1): field 'chosen' must be a string, got list"),
    ("rl-file-as-preference", "x.jsonl", lambda p: _raw(p, _lines(_rl())), ["--kind", "preference"],
     1, "6 rows (row 0 (line 1), row 1 (line 2), row 2 (line 3), ...): missing field 'chosen'"),
    ("pairs-without-prompt", "x.jsonl", lambda p: _raw(p, _lines(_edit(_pairs(), 0, prompt=_DROP))),
     [], 1, "row 0 (line 1): missing field 'prompt'"),
    # token limits
    ("token-limit-without-tokenizer", "x.jsonl", lambda p: _raw(p, _lines(_rl())),
     ["--max-prompt-tokens", "8"], 2, "--max-prompt-tokens 8 needs --tokenizer"),
    ("tokenizer-dir-wrong", "x.jsonl", lambda p: _raw(p, _lines(_rl())),
     ["--tokenizer", "{dir}"], 2, "no tokenizer_config.json there"),
    ("prompt-over-limit", "x.jsonl",  # row 0: 20 tokens after the chat template, the rest 13
     lambda p: _raw(p, _lines(_edit(_rl(), 0, prompt=[{"role": "user", "content": "copy 0123456789"}]))),
     ["--tokenizer", "{model}", "--max-prompt-tokens", "16"], 1,
     "row 0 (line 1): prompt is 20 tokens, over max_prompt_tokens=16"),
    ("every-prompt-over-limit", "x.jsonl", lambda p: _raw(p, _lines(_rl())),
     ["--tokenizer", "{model}", "--max-prompt-tokens", "4"], 1,
     "every prompt (6 rows) is over --max-prompt-tokens=4 tokens (the shortest is 13 tokens"),
    ("drop-leaves-nothing", "x.jsonl", lambda p: _raw(p, _lines(_rl())),
     ["--tokenizer", "{model}", "--max-prompt-tokens", "4", "--overlong", "drop"], 1,
     "--overlong drop leaves no rows"),
]  # fmt: skip


def _digest(path: Path) -> str | None:
    if not path.exists() or path.is_dir():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_dataset_gets_a_named_error(case, tmp_path, tiny_model_dir, capsys):
    _, name, build, extra, code, expected = case
    path = tmp_path / name
    if build is not None:
        build(path)
    before = _digest(path)
    fill = {"{model}": str(tiny_model_dir), "{dir}": str(tmp_path), "{path}": str(path)}
    args = [next((v for k, v in fill.items() if a == k), a) for a in extra]
    assert main(["validate-dataset", str(path), *args]) == code
    err = capsys.readouterr().err
    for part in expected.split("|"):
        assert part.replace("{path}", str(path)) in err, err
    assert "Traceback" not in err
    assert _digest(path) == before, "validate-dataset modified the file"


def test_unreadable_file_is_named(tmp_path):
    """A file its reader may not open. Root reads any file whatever its mode, so under root
    (CI) the command runs without the capabilities that let it (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH, dropped from its bounding set before exec)."""
    import ctypes
    import subprocess
    import sys

    path = write_dataset(_rl(), tmp_path / "x.jsonl")
    path.chmod(0)

    def drop_file_override() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; PR_CAPBSET_DROP = 24
            if os.geteuid() == 0 and libc.prctl(24, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    out = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "validate-dataset", str(path)],
        capture_output=True,
        text=True,
        preexec_fn=drop_file_override,
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"file '{path}' is not readable (Permission denied)" in out.stderr, out.stderr


def test_summary_table_counts_rows_dropped_or_truncated(tmp_path, tiny_model_dir, capsys):
    rows = _rl(6)
    for row in rows[:2]:  # two long prompts among six
        row["prompt"][0]["content"] = "copy " + "1234567890" * 4
    path = write_dataset(rows, tmp_path / "x.jsonl")
    base = ["validate-dataset", str(path), "--tokenizer", str(tiny_model_dir)]
    for policy, verb in (("drop", "dropped"), ("truncate_left", "truncated")):
        assert main([*base, "--max-prompt-tokens", "24", "--overlong", policy]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"OK {path}: 6 rows (polyrl/copy: 6)")
        assert f"rows {verb} (over the token limit)  2" in out, out
        assert "schema" in out and "rl (polyrl fields)" in out
    assert main([*base, "--max-prompt-tokens", "24"]) == 1
    err = capsys.readouterr().err
    # 10 template tokens + "copy" + " " + 40 digits = 50 (as the 13 of "copy 123" in
    # test_tasks_and_schema.py); both long rows on one line
    assert "2 rows (row 0 (line 1) (50 tokens), row 1 (line 2) (50 tokens)): prompt over" in err
    assert "row 2 (line 3)" not in err


def _mixed(path: Path, tmp_path: Path) -> list[dict]:
    """Eight rows in jsonl with a problem of each kind: line 2 cut inside a string, line 5
    a row without ground_truth, line 7 a non-UTF-8 byte, line 8 a long prompt. Returns
    the four good rows (lines 1, 3, 4, 6)."""
    rows = _rl(8)
    rows[7]["prompt"][0]["content"] = "copy " + "1234567890" * 4
    lines = _lines(rows).split(b"\n")
    lines[1] = lines[1][: lines[1].index(b'"content": "') + 14]  # Unterminated string
    lines[4] = json.dumps(_edit(_rl(8), 4, ground_truth=_DROP)[4]).encode()
    lines[6] = lines[6].replace(b"copy", b"c\xffpy")
    _raw(path, b"\n".join(lines))
    return [rows[i] for i in (0, 2, 3, 5)]


def test_every_problem_in_one_pass(tmp_path, tiny_model_dir, capsys):
    """Issue 47: validate-dataset stopped at the broken line and named the row without
    ground_truth only on the next run (and said "at at")."""
    path = tmp_path / "x.jsonl"
    _mixed(path, tmp_path)
    tok = ["--tokenizer", str(tiny_model_dir), "--max-prompt-tokens", "24"]
    assert main(["validate-dataset", str(path), *tok]) == 1
    err = capsys.readouterr().err
    assert "line 2: invalid JSON (Unterminated string starting at column" in err, err
    assert "(line 5): missing field 'ground_truth'" in err, err
    assert "line 7: not UTF-8 (byte 0xff at column" in err, err
    assert "(line 8) (50 tokens)" in err or "(line 8): prompt is 50 tokens" in err, err
    assert err.startswith(f"INVALID {path} (8 rows): 4 problem(s)"), err
    assert "at at" not in err
    assert f"polyrl validate-dataset {path} --bad-rows drop --out CLEAN.jsonl" in err


def test_bad_rows_drop_writes_a_clean_copy(tmp_path, tiny_model_dir, capsys):
    path, clean = tmp_path / "x.jsonl", tmp_path / "clean.jsonl"
    good = _mixed(path, tmp_path)
    before = _digest(path)
    tok = ["--tokenizer", str(tiny_model_dir), "--max-prompt-tokens", "24"]
    args = ["validate-dataset", str(path), *tok, "--bad-rows", "drop"]
    assert main(args) == 2  # a usage error: the copy needs --out (the input is never modified)
    assert "--bad-rows drop needs --out" in capsys.readouterr().err
    assert main([*args, "--out", str(clean)]) == 0
    out = capsys.readouterr().out
    assert f"dropped 4 of 8 lines of {path}" in out and f"wrote 4 rows to {clean}" in out, out
    assert [json.loads(line) for line in clean.read_text().splitlines()] == good
    assert _digest(path) == before
    assert main(["validate-dataset", str(clean), *tok]) == 0
    assert capsys.readouterr().out.startswith(f"OK {clean}: 4 rows")
