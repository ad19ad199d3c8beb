"""Greedy exact match on chat rows: what the SFT tests measure learning by."""

from __future__ import annotations


def greedy_exact_match(model_dir, rows, tokenizer=None) -> float:
    """Share of ``rows`` (chat rows: ``messages`` = [user, assistant, ...]) whose first
    assistant answer transformers' greedy decoding of the model at ``model_dir`` gives,
    prompted exactly as an RL prompt (``polyrl.data.prompts.encode_prompt``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.data.prompts import encode_prompt

    tok = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hits = 0
    for row in rows:
        prompt = encode_prompt(tok, row["messages"][:1])
        with torch.no_grad():
            out = model.generate(
                torch.as_tensor([prompt]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        answer = tok.decode(out[0, len(prompt) :], skip_special_tokens=True)
        hits += answer == row["messages"][1]["content"]
    return hits / len(rows)
