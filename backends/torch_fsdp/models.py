"""Hugging Face models for each role and the per-token outputs they produce.

Roles (``ModelConfig.role``):

* ``actor`` / ``reference``: ``AutoModelForCausalLM`` (any family transformers supports:
  Qwen2/2.5/3, Llama, Mistral, ...). Output ``log_probs`` [B, R] (and ``entropy``).
* ``critic`` / ``reward``: :class:`ValueModel` = the family's base model
  (``AutoModel``, the decoder without ``lm_head``) + a scalar head ``score``. Parameter
  names are those of ``AutoModelForSequenceClassification`` (``model.*`` + ``score.weight``),
  so an exported critic/reward model loads there with ``num_labels=1``.

Alignment (shapes: B samples, P prompt tokens, R response tokens, L = P + R, V vocab):
position ``P - 1 + t`` predicts response token ``t`` (``polyrl.batch``). Both
``log_probs[:, t]`` and ``values[:, t]`` are read at that position, so ``values[:, t]`` is
V(s_t), the value of the state *before* response token ``t`` is emitted -- verl's
convention (``values[:, -R-1:-1]``). A reward model scores a sequence at its last real
token (the last position with ``attention_mask == 1``), as
``AutoModelForSequenceClassification`` does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from polyrl.backends.base import ENGINES
from polyrl.backends.torch_fsdp import attention, compiling, lm_head, lora, recompute
from polyrl.config import ModelConfig

__all__ = [
    "ValueModel",
    "LoadedModel",
    "load_model",
    "load_tokenizer",
    "check_path",
    "find_value_head",
    "policy_outputs",
    "value_outputs",
]


# Where known checkpoints keep a scalar head: HF sequence/token classification (also
# verl's critic), OpenRLHF ("value_head"), TRL's AutoModelForCausalLMWithValueHead.
VALUE_HEAD_PREFIXES = ("score", "value_head", "v_head.summary", "v_head")


class ValueModel(nn.Module):
    """Decoder backbone + linear scalar head: ``values = score(last_hidden_state)``.

    ``model``: the family's base model (e.g. ``Qwen2Model``); ``score``: ``Linear(H, 1)``,
    with a bias only when the checkpoint it came from had one.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, bias: bool = False):
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, 1, bias=bias, dtype=backbone.dtype)
        # Kept for HF helpers (_no_split_modules, gradient checkpointing) and save_hf.
        self.config = backbone.config

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """[B, L] ids/masks -> values [B, L] (fp32)."""
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        # A copy, not a view: FSDP2 warns that in-place ops on a returned view would
        # skip its pre-backward hook.
        return self.score(hidden).squeeze(-1).to(torch.float32, copy=True)


@dataclasses.dataclass
class LoadedModel:
    """A role's module before sharding, and the decoder-layer classes FSDP wraps."""

    module: nn.Module
    layer_classes: set[str]
    hf_config: object


def check_path(cfg: ModelConfig) -> Path:
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"ModelConfig.path={cfg.path!r} {what}; it must be a local Hugging Face model "
            "directory (config.json + *.safetensors + tokenizer files), e.g. one written by "
            "save_pretrained or polyrl.data.tiny.ensure_tiny_model"
        )
    return path


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer saved next to the model; a clear error when it is missing."""
    from transformers import AutoTokenizer

    path = check_path(cfg)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        raise FileNotFoundError(
            f"ModelConfig.path={cfg.path!r} has no tokenizer (none of {list(names)}); save the "
            "tokenizer into the model directory (tokenizer.save_pretrained(path))"
        )
    return AutoTokenizer.from_pretrained(path)


def _safetensors_files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"ModelConfig.value_head_path={str(path)!r} holds no *.safetensors file; point it "
            "at a reward-model/critic directory or a .safetensors file with a scalar head"
        )
    return files


def find_value_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [1, H], bias [1] or None)`` of the scalar head stored in ``path`` (a
    directory of safetensors or one file), looked up under :data:`VALUE_HEAD_PREFIXES`;
    None when there is none."""
    from safetensors import safe_open

    for file in _safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for prefix in VALUE_HEAD_PREFIXES:
                if f"{prefix}.weight" in keys:
                    weight = f.get_tensor(f"{prefix}.weight")
                    bias = f.get_tensor(f"{prefix}.bias") if f"{prefix}.bias" in keys else None
                    if weight.ndim != 2 or weight.shape[0] != 1:
                        raise ValueError(
                            f"{file}: {prefix}.weight has shape {tuple(weight.shape)}; a value "
                            "head must be [1, hidden_size] (num_labels=1)"
                        )
                    return weight, bias
    return None


def _value_model(cfg: ModelConfig, dtype: torch.dtype) -> ValueModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(
        cfg.path, dtype=dtype, attn_implementation=cfg.attn_implementation
    )
    # An explicit value_head_path must hold a head; otherwise a head already in the
    # model checkpoint (a reward model / saved critic) is used, else zeros.
    head = find_value_head(cfg.value_head_path or cfg.path)
    if head is None and cfg.value_head_path is not None:
        raise ValueError(
            f"ModelConfig.value_head_path={cfg.value_head_path!r} has no scalar head (looked for "
            f"{[p + '.weight' for p in VALUE_HEAD_PREFIXES]}); point it at a reward model or "
            "critic checkpoint, or set it to None for a zero-initialised head"
        )
    hidden = backbone.config.hidden_size
    model = ValueModel(backbone, hidden, bias=head is not None and head[1] is not None)
    with torch.no_grad():
        if head is None:
            model.score.weight.zero_()
        else:
            if head[0].shape[1] != hidden:
                raise ValueError(
                    f"value head in {cfg.value_head_path or cfg.path!r} has width "
                    f"{head[0].shape[1]} but the backbone's hidden_size is {hidden}"
                )
            model.score.weight.copy_(head[0])
            if head[1] is not None:
                model.score.bias.copy_(head[1])
    return model


def load_model(
    cfg: ModelConfig, master_dtype: torch.dtype, logits_chunk_tokens: int = 1024
) -> LoadedModel:
    """Load ``cfg.path`` on the host in ``master_dtype`` for ``cfg.role``.

    Frozen roles pass their compute dtype; trainable roles fp32 master weights (FSDP's
    mixed-precision policy casts to the compute dtype for forward/backward); a LoRA actor
    its compute dtype for the frozen base, with fp32 adapters (``lora.inject``). A causal
    LM's head becomes a :class:`~polyrl.backends.torch_fsdp.lm_head.ChunkedLMHead` of
    ``logits_chunk_tokens`` tokens per chunk.
    """
    from transformers import AutoModelForCausalLM

    check_path(cfg)
    problem = ENGINES["torch_fsdp"].checkpoint_problem(cfg, "ModelConfig")
    if problem:  # before any weight is read
        raise ValueError(problem)
    if cfg.attn_implementation == attention.NAME:
        attention.register()
    if cfg.has_value_head:
        module: nn.Module = _value_model(cfg, master_dtype)
        backbone = module.model
    else:
        module = backbone = AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=master_dtype, attn_implementation=cfg.attn_implementation
        )
        lm_head.install(module, logits_chunk_tokens, cfg.compile)
    backbone.config.use_cache = False
    if cfg.gradient_checkpointing and cfg.checkpoint_policy == "full":
        # Non-reentrant checkpointing composes with FSDP2's hooks (re-gathers the layer).
        backbone.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    if not cfg.trainable:
        module.requires_grad_(False)
    if cfg.lora is not None:  # before compile and FSDP wrap the layers
        lora.inject(module, cfg.lora)
    layers = set(getattr(backbone, "_no_split_modules", None) or ())
    if cfg.gradient_checkpointing and cfg.checkpoint_policy == "selective" and not cfg.compile:
        _wrap_layers(module, layers, recompute.selective)
    if cfg.compile:
        budget = cfg.gradient_checkpointing and cfg.checkpoint_policy == "budget" and cfg.trainable
        memory = cfg.activation_memory_budget if budget else None
        _wrap_layers(module, layers, functools.partial(compiling.compiled, memory_budget=memory))
    return LoadedModel(module, layers, backbone.config)


def _wrap_layers(module: nn.Module, layer_names: set[str], wrap: Callable) -> None:
    """Replace the ``forward`` of each decoder layer by ``wrap(forward)``: selective
    activation checkpointing (``recompute``) or ``torch.compile`` (``ModelConfig.compile``).

    Only the instance's ``forward`` is replaced, so FSDP2's hooks (in
    ``nn.Module.__call__``) and HF's full checkpointing (the layer's ``__call__``) stay
    outside, as in eager mode. Compiled layers share one code object (same class, same
    function), compiled once per variant (``compiling``), and take no selective
    checkpoint: inductor's partitioner already keeps the matmul outputs and recomputes
    the pointwise work of each compiled graph, and a checkpoint around the graph break of
    ``polyrl_varlen`` attention would make dynamo run the whole layer eagerly."""
    for m in module.modules():
        if type(m).__name__ in layer_names:
            m.forward = wrap(m.forward)


def _mask(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: a non-finite value at a padded position must not leak as NaN.
    return torch.where(response_mask > 0, x, torch.zeros_like(x))


def _packed(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The micro-batch as one row of its real tokens (no padding): ``input_ids`` and
    ``position_ids`` [1, N] with positions restarting at 0 for every sequence (transformers
    then masks attention to each sequence: its packed-sequence detection, used when
    ``attention_mask`` is None), ``varlen`` the sequence boundaries for the
    ``polyrl_varlen`` attention (``attention.py``; other implementations ignore them),
    ``keep`` [K + 1] the positions predicting each real response token (plus one more,
    which the head drops), ``targets`` [1, K] those tokens and ``where`` [B, R] where the
    K scores go back."""
    real = inputs["attention_mask"] != 0
    lengths = real.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    n = int(lengths.sum())
    positions = torch.arange(n, device=real.device) - torch.repeat_interleave(starts, lengths)
    r = inputs["responses"].shape[1]
    where = real[:, -r:]
    prompt_len = real[:, :-r].sum(1)
    predicts = (starts + prompt_len - 1)[:, None] + torch.arange(r, device=real.device)
    keep = predicts[where]
    cu = attention.cu_seqlens(lengths[lengths > 0])  # empty rows are no sequence
    max_len = int(lengths.max())
    return {
        "input_ids": inputs["input_ids"][real][None],
        "position_ids": positions[None],
        "varlen": {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max_len,
            "max_length_k": max_len,
        },
        "keep": torch.cat([keep, keep[-1:]]),
        "targets": inputs["responses"].long()[where][None],
        "where": where,
    }


def policy_outputs(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    temperature: float,
    entropy: bool,
    vocab: int | None = None,
    pack: bool = False,
) -> dict[str, torch.Tensor]:
    """``log_probs`` [B, R] = log_softmax(logits / temperature) at the response tokens (how
    vLLM scores sampled tokens), ``entropy`` [B, R] of that same distribution; 0 where
    ``response_mask`` is 0. Only the positions that predict the response reach the head,
    which scores them in chunks (``lm_head.ChunkedLMHead``): the fp32 [B, R, V] logits
    never exist at once. ``vocab``: the distribution covers ids ``< vocab`` only
    (ModelConfig.sampling_vocab_size). ``pack``: run the micro-batch as one row without
    padding (:func:`_packed`); same outputs."""
    responses = inputs["responses"].long()
    head = model.get_output_embeddings()
    if pack and bool((inputs["attention_mask"][:, -responses.shape[1] :] != 0).any()):
        packed = _packed(inputs)
        with head.scoring(packed["targets"], temperature, entropy, vocab):
            flat = model(
                input_ids=packed["input_ids"],
                position_ids=packed["position_ids"],
                logits_to_keep=packed["keep"],
                use_cache=False,
                **packed["varlen"],
            ).logits[0]
        scores = flat.new_zeros((*responses.shape, flat.shape[-1])).index_put(
            (packed["where"],), flat
        )
    else:
        # The last R + 1 positions are P-1 .. L-1; the head drops the last (predicts nothing).
        with head.scoring(responses, temperature, entropy, vocab):
            scores = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                position_ids=inputs["position_ids"],
                logits_to_keep=responses.shape[1] + 1,
                use_cache=False,
            ).logits
    result = {"log_probs": _mask(scores[..., 0], inputs["response_mask"])}
    if entropy:
        result["entropy"] = _mask(scores[..., 1], inputs["response_mask"])
    return result


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B]: index of the last position with ``attention_mask == 1``."""
    L = attention_mask.shape[1]
    return L - 1 - torch.argmax(attention_mask.flip(1).int(), dim=1)


def value_outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` [B, R] (V(s_t) at position P-1+t, 0 where ``response_mask`` is 0) and
    ``scores`` [B] = the head at each sequence's last real token (a reward model's score,
    read from a critic too: a reward model in training is one)."""
    R = inputs["responses"].shape[1]
    full = model(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    idx = last_token_index(inputs["attention_mask"])
    return {
        "values": _mask(full[:, -R - 1 : -1], inputs["response_mask"]),
        "scores": full.gather(1, idx[:, None]).squeeze(1),
    }
