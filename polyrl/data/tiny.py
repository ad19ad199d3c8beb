"""A tiny random Qwen2 model and a character tokenizer, built locally with no network.

``build_tiny_model(dir)`` writes one Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template) that
transformers, vLLM and both polyrl backends load like any checkpoint. The tokenizer
is a Qwen2 byte-level BPE trained with ``tokenizers`` on the tasks' text
(``polyrl.data.tasks.corpus``): one token per digit, so a small model can learn the tasks.

``ensure_tiny_model(root)`` builds it once under ``root`` and reuses it afterwards
(keyed by a fingerprint of the recipe, so a changed recipe builds a new directory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

from polyrl.data.tasks import corpus

__all__ = [
    "TinyModelSpec",
    "build_tokenizer",
    "build_tiny_model",
    "ensure_tiny_model",
    "SPECIAL_TOKENS",
]

PAD, EOS, IM_START, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, UNK)

# Qwen-style chat template; the assistant turn ends with <|im_end|> (the EOS token).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ':' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. head_dim = hidden_size / num_attention_heads = 32 (a size
    vLLM's CPU attention supports). Defaults give ~0.4M parameters."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    # Pad the embedding table to a multiple of this. 1 (no padding) keeps every row a real
    # token, so vLLM never samples an id the tokenizer cannot decode and the trainer's
    # full-vocabulary log-softmax equals the sampler's distribution.
    vocab_multiple: int = 1
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    seed: int = 0

    def fingerprint(self) -> str:
        recipe = json.dumps(
            {
                "spec": dataclasses.asdict(self),
                "corpus": corpus(),
                "template": CHAT_TEMPLATE,
                "special": SPECIAL_TOKENS,
                "version": 1,
            },
            sort_keys=True,
        )
        return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def build_tokenizer(vocab_size: int = 64):
    """A Qwen2 tokenizer (byte-level BPE) trained with ``tokenizers`` on the task alphabet.

    The BPE is trained with the exact pre-tokenizer Qwen2's tokenizer uses (taken from
    ``Qwen2Tokenizer`` itself), so transformers' ``AutoTokenizer`` -- which rebuilds a
    Qwen2 model's tokenizer from vocab + merges -- and vLLM tokenize exactly as trained.
    That pre-tokenizer isolates every digit, so numbers are one token per digit; merges
    only join letters ("user", "copy", ...). The initial alphabet is the corpus'
    characters only, which keeps the vocabulary (and the model) tiny.
    """
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import Qwen2Tokenizer

    # Qwen2's normaliser/pre-tokenizer/decoder, read off a throwaway instance.
    reference = Qwen2Tokenizer(vocab={PAD: 0}, merges=[]).backend_tokenizer
    tok = Tokenizer(models.BPE())
    tok.normalizer = reference.normalizer
    tok.pre_tokenizer = reference.pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=[],
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    fast = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=merges,
        unk_token=UNK,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=256,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None) -> Path:
    """Write a random Qwen2ForCausalLM (fp32) and its tokenizer to ``out_dir``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, set_seed

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    vocab_padded = -(-vocab // spec.vocab_multiple) * spec.vocab_multiple
    config = Qwen2Config(
        vocab_size=vocab_padded,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    set_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()  # a "Writing model shards" bar for one file
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    (out / "polyrl_tiny.json").write_text(
        json.dumps({"fingerprint": spec.fingerprint(), **dataclasses.asdict(spec)}, indent=1)
    )
    return out


def ensure_tiny_model(root: str | os.PathLike, spec: TinyModelSpec | None = None) -> Path:
    """Path of the tiny model under ``root``, building it first if it is not there.

    Built into a temporary sibling and renamed, so a crash never leaves a half-written
    model that later runs would trust.
    """
    spec = spec or TinyModelSpec()
    root = Path(root)
    target = root / f"tiny-qwen2-{spec.fingerprint()}"
    if (target / "polyrl_tiny.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    build_tiny_model(tmp, spec)
    try:
        tmp.rename(target)
    except OSError:  # built concurrently by another process: use theirs
        if not (target / "polyrl_tiny.json").exists():
            raise
    return target
