"""A random-weight Qwen2 model of a real Qwen2.5 shape, as a Hugging Face directory.

The weights are drawn on the GPU when there is one (a 7B model in bf16 takes seconds
there against minutes on the host), saved as safetensors with the tiny tokenizer and the
copy task's chat template (polyrl/data/tiny.py: ids are all a benchmark's prompts need),
so rollout and GRPO benchmarks of large shapes need no download:

    python experiments/bench/random_model.py 7b /tmp/models/qwen2-7b-random
    python experiments/bench/random_model.py 0.5b /tmp/models/qwen2-0.5b-random --max-positions 1024
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

# Qwen2.5 shapes (their config.json files); vocab 151936 for 0.5B/1.5B, 152064 for 7B.
SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def build(shape: str, out: Path, max_positions: int = 4096, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from polyrl.data.tiny import CHAT_TEMPLATE, ensure_tiny_model

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=max_positions, torch_dtype=dtype)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(Path(tmp) / "tiny"))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = max_positions  # the tiny model's 256 would warn on long rows
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    if (args.out / "config.json").exists():
        print(f"{args.out} exists")
        return
    print(build(args.shape, args.out, args.max_positions, args.dtype))


if __name__ == "__main__":
    main()
