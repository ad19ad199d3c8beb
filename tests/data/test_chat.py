"""SFT chat data: per-assistant-turn loss masks from the chat template, the SFT row
schema's named errors, and the chat rows of the built-in tasks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyrl.data.chat import TemplateError, encode_chat
from polyrl.data.loader import ChatSource
from polyrl.data.schema import DatasetError, detect_kind, validate_file, validate_rows
from polyrl.data.tasks import make_chat_rows


@pytest.fixture(scope="module")
def tok():
    from polyrl.data.tiny import build_tokenizer

    return build_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_multi_turn_mask_is_one_on_assistant_tokens_only(tok):
    messages = [
        {"role": "system", "content": "copy"},
        {"role": "user", "content": "copy 12"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "copy 345"},
        {"role": "assistant", "content": "345"},
    ]
    chat = encode_chat(tok, messages)
    # Written out by hand from the tiny template: <|im_start|>role:content<|im_end|>.
    prompt = (
        "<|im_start|>system:copy<|im_end|><|im_start|>user:copy 12<|im_end|><|im_start|>assistant:"
    )
    turn1, between, turn2 = (
        "12<|im_end|>",
        "<|im_start|>user:copy 345<|im_end|><|im_start|>assistant:",
        "345<|im_end|>",
    )
    assert chat.prompt == _ids(tok, prompt)
    assert chat.response == _ids(tok, turn1) + _ids(tok, between) + _ids(tok, turn2)
    n1, nb, n2 = (len(_ids(tok, t)) for t in (turn1, between, turn2))
    assert (n1, n2) == (3, 4)  # one token per digit, then <|im_end|>
    assert chat.mask == [1] * n1 + [0] * nb + [1] * n2
    # the whole sequence is the template's rendering of the conversation
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(chat.prompt + chat.response) == full
    # the prompt is what an RL prompt of the first exchange encodes to
    from polyrl.data.prompts import encode_prompt

    assert chat.prompt == encode_prompt(tok, messages[:2])


def test_chat_source_batch_carries_the_masks(tok):
    rows = make_chat_rows("copy", 6)
    assert [len(r["messages"]) for r in rows] == [2, 2, 4, 2, 2, 4]
    src = ChatSource(rows, tok, max_prompt_tokens=64)
    batch = src.take(np.arange(6))
    mask = batch["response_mask"]
    for i, row in enumerate(rows):
        chat = encode_chat(tok, row["messages"])
        assert mask[i, : len(chat.mask)].tolist() == chat.mask
        assert not mask[i, len(chat.mask) :].any()  # padding
        # response tokens under the mask are exactly the assistant answers + <|im_end|>
        learned = batch["responses"][i][mask[i] > 0].tolist()
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert learned == [t for a in answers for t in _ids(tok, a + "<|im_end|>")]


def test_sft_row_errors_are_named(tok):
    rows = [
        {"messages": [{"role": "user", "content": "copy 1"}]},
        {"messages": [{"role": "assistant", "content": "1"}, {"role": "user", "content": "x"}]},
        {"messages": "copy 1"},
        {"messages": [{"role": "user", "content": "copy 1"}, {"role": "bot", "content": ""}]},
        {"prompt": [{"role": "user", "content": "copy 1"}]},
        {
            "messages": [
                {"role": "user", "content": "copy 1"},
                {"role": "assistant", "content": "1"},
            ]
        },
    ]
    with pytest.raises(DatasetError) as info:
        validate_rows(rows, "mem", kind="sft")
    msg = str(info.value)
    # rows with the same problem share one line (issue 34)
    assert "2 rows (row 0, row 3): messages has no assistant message, so there is nothing" in msg
    assert "row 1: messages[0] is an assistant message" in msg
    assert "row 2: field 'messages' must be a non-empty list of chat messages" in msg
    assert "row 3: messages[1].role='bot' is not one of" in msg
    assert "row 3: messages[1].content must be a non-empty string" in msg
    assert "row 4: missing field 'messages' (required fields: ['messages'])" in msg
    assert "row 5" not in msg
    assert len(info.value.problems) == 6  # row 3's missing assistant shares row 0's line


def test_validate_file_detects_sft_and_limits_whole_conversations(tok, tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = make_chat_rows("copy", 3)
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert detect_kind(rows) == "sft"
    report = validate_file(path, tok)
    assert report.kind == "sft" and report.n_rows == 3
    longest = max(
        len(c.prompt) + len(c.response)
        for c in map(lambda r: encode_chat(tok, r["messages"]), rows)
    )
    assert report.max_prompt_tokens == longest  # the multi-turn row, counted whole
    with pytest.raises(DatasetError, match="row 2 \\(line 3\\): prompt is"):
        validate_file(path, tok, max_prompt_tokens=longest - 1)


def test_a_template_that_is_not_incremental_is_refused(tok):
    import copy

    odd = copy.deepcopy(tok)  # renders the number of messages first: no common prefix
    odd.chat_template = "{{ messages | length }}" + tok.chat_template
    messages = [{"role": "user", "content": "copy 1"}, {"role": "assistant", "content": "1"}]
    with pytest.raises(TemplateError, match="assistant turn 1"):
        encode_chat(odd, messages)
