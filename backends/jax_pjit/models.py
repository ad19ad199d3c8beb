"""Flax NNX decoder-only transformers for the Qwen2 / Qwen2.5, Qwen3 and Llama families.

The modules mirror Hugging Face's module tree, so every parameter's NNX path is its HF
name and its array has HF's layout: a linear layer's ``weight`` is ``[out, in]``, applied
as ``x @ weight.T`` by a ``dot_general`` that XLA's GEMMs run without a transpose, so
export writes the arrays as they are. Shapes (module-wide): ``B`` batch, ``T`` sequence,
``E`` hidden size, ``H`` query heads, ``K`` key/value heads, ``D`` head size, ``V``
vocabulary.

Numerics follow transformers' eager code path: RMSNorm and softmax in fp32, RoPE with
``rotate_half`` and HF's inverse frequencies (default, linear, llama3, yarn), GQA by
grouping query heads over shared key/value heads. Which tokens attend to which is given
by ``segment_ids`` (``attention.py``: an ``attention_mask`` is one, a packed row numbers
its sequences) and explicit ``position_ids`` (polyrl.batch's layout, or restarting per
packed sequence), so left- and right-padded or packed rows give the same outputs on
their real tokens as unpadded ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from polyrl.backends.jax_pjit import recompute
from polyrl.backends.jax_pjit.attention import attend
from polyrl.tensor import log_probs_and_entropy

__all__ = [
    "ARCHITECTURES",
    "TransformerConfig",
    "CausalLM",
    "rope_inv_freq",
]

# HF architecture (config.json "architectures"[0]) -> family. Sequence/token
# classification heads are reward models / critics saved by TRL, OpenRLHF or verl.
ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2ForTokenClassification": "qwen2",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3ForTokenClassification": "qwen3",
    "Qwen3ForSequenceClassification": "qwen3",
    "LlamaForCausalLM": "llama",
    "LlamaForTokenClassification": "llama",
    "LlamaForSequenceClassification": "llama",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


def _no_constraint(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    return x


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The architecture fields the JAX models read, parsed from an HF ``config.json``.

    ``rope`` holds HF's ``rope_parameters`` (transformers >= 5) or the older
    ``rope_theta`` + ``rope_scaling`` pair, normalised to one sorted tuple of items.
    """

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    rope: tuple[tuple[str, Any], ...]

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], where: str = "config.json") -> TransformerConfig:
        """Parse an HF config dict; unsupported architectures/features raise with the fix."""
        arch = (cfg.get("architectures") or ["<missing>"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{where}: architecture {arch!r} is not supported by the jax_pjit backend; "
                f"supported: {sorted(ARCHITECTURES)} (use the torch_fsdp backend for others)"
            )
        family = ARCHITECTURES[arch]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"{where}: hidden_act={cfg['hidden_act']!r}; only 'silu' (SwiGLU) is supported"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError(
                f"{where}: use_sliding_window=true is not supported by the jax_pjit backend; "
                "set it to false (Qwen2.5 checkpoints ship with it off)"
            )
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(
                f"{where}: rope_type={rope['rope_type']!r} is not supported; supported: {list(ROPE_TYPES)}"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=tuple(sorted(rope.items())),
        )


def rope_inv_freq(config: TransformerConfig) -> tuple[np.ndarray, float]:
    """HF's RoPE inverse frequencies [D/2] (fp32) and the cos/sin scale (yarn's mscale).

    Mirrors ``transformers.modeling_rope_utils``: ``default`` ``theta^(-2i/D)``;
    ``linear`` divides by ``factor``; ``llama3`` (Llama 3.1) rescales low frequencies by
    ``factor`` and interpolates the band between; ``yarn`` (Peng et al. 2023) blends
    interpolated and extrapolated frequencies with a linear ramp and scales cos/sin by
    ``0.1 ln(factor) + 1``.
    """
    p = dict(config.rope)
    dim, base = config.head_dim, float(p["rope_theta"])
    # float32 exponent, as HF computes it, so frequencies match bit for bit where possible
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    kind = p["rope_type"]
    if kind == "linear":
        return inv_freq / np.float32(p["factor"]), 1.0
    if kind == "llama3":
        factor, old = p["factor"], p["original_max_position_embeddings"]
        low, high = old / p["low_freq_factor"], old / p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - p["low_freq_factor"]) / (
            p["high_freq_factor"] - p["low_freq_factor"]
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high) & (wavelen <= low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(p, dim, base, config.max_position_embeddings)
    return inv_freq, 1.0


def _yarn(p: dict, dim: int, base: float, max_pos: int) -> tuple[np.ndarray, float]:
    old = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv.astype(np.float32), float(attn)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _matmul_t(x: jax.Array, w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """``x @ w.T`` for ``w`` [out, in]: one ``dot_general`` contracting the last axes of
    both (GPU GEMMs take the transposed operand as it is; no transpose is made)."""
    return jax.lax.dot_general(
        x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=preferred_element_type
    )


def _head_logits(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """The LM head's logits in fp32: a GEMM in the compute dtype (fp32 accumulation,
    output rounded to that dtype), then cast — what the torch backend's
    ``F.linear(...).float()`` and vLLM compute. Its backward casts the fp32 cotangent to
    the compute dtype and runs bf16 GEMMs; asking the GEMM for fp32 output instead
    (``preferred_element_type``) makes both backward GEMMs fp32 (TF32 on GPU: the slowest
    GEMMs of the JAX train step's trace, docs/performance.md)."""
    return _matmul_t(hidden, weight).astype(jnp.float32)


class Linear(nnx.Module):
    """``y = x @ weight.T + bias`` with ``weight`` [out, in] (HF's name and layout).

    With ``lora`` (a ``polyrl.config.LoraConfig``), LoRA adapters ``lora_A.weight``
    [rank, in] and ``lora_B.weight`` [out, rank] (PEFT's names, without its adapter
    name) add ``scale * B A dropout(x)``; ``key`` draws the dropout mask (None: no
    dropout, as in every forward without gradients). Their values come from
    ``lora.init_adapters`` (B zero), not from this initialiser."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        bias: bool,
        dtype: Any,
        rngs: nnx.Rngs,
        init: Callable | None = None,
        lora: Any = None,
    ):
        init = init or nnx.initializers.normal(0.02)
        self.weight = nnx.Param(init(rngs.params(), (d_out, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        if lora is None:
            self.lora_A = self.lora_B = None
        else:
            zeros = nnx.initializers.zeros_init()
            self.lora_A = Linear(d_in, lora.rank, bias=False, dtype=dtype, rngs=rngs, init=zeros)
            self.lora_B = Linear(lora.rank, d_out, bias=False, dtype=dtype, rngs=rngs, init=zeros)
            self.lora_scale, self.lora_dropout = lora.scale, lora.dropout

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        y = _matmul_t(x, self.weight[...])
        if self.lora_A is not None:
            h = x
            if key is not None and self.lora_dropout > 0:
                keep = jax.random.bernoulli(key, 1.0 - self.lora_dropout, x.shape)
                h = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
            y = y + self.lora_B(self.lora_A(h)) * jnp.asarray(self.lora_scale, y.dtype)
        return y + self.bias[...] if self.bias is not None else y


def _adapted(lora: Any, name: str) -> Any:
    """``lora`` when it adapts projection ``name`` (``LoraConfig.target_modules``)."""
    return lora if lora is not None and name in lora.target_modules else None


def _key(key: jax.Array | None, i: int) -> jax.Array | None:
    """The ``i``-th dropout key under ``key`` (None stays None: no dropout)."""
    return None if key is None else jax.random.fold_in(key, i)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in fp32 (as HF)."""

    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype: Any, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class Attention(nnx.Module):
    """Causal GQA self-attention with RoPE (and Qwen3's per-head q/k RMSNorm) within
    segments; ``implementation``: ``attention.resolve``'s choice."""

    def __init__(
        self,
        c: TransformerConfig,
        dtype: Any,
        rngs: nnx.Rngs,
        constrain: Constrain,
        implementation: str = "xla",
        lora: Any = None,
    ):
        e, d = c.hidden_size, c.head_dim

        def proj(name, d_in, d_out, bias):
            return Linear(d_in, d_out, bias=bias, dtype=dtype, rngs=rngs, lora=_adapted(lora, name))

        self.q_proj = proj("q_proj", e, c.num_heads * d, c.qkv_bias)
        self.k_proj = proj("k_proj", e, c.num_kv_heads * d, c.qkv_bias)
        self.v_proj = proj("v_proj", e, c.num_kv_heads * d, c.qkv_bias)
        self.o_proj = proj("o_proj", c.num_heads * d, e, c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(d, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.c, self.constrain, self.implementation = c, constrain, implementation

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segments: tuple[jax.Array, int],
        key: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, T, E]; cos/sin [B, T, D]; segments: (segment_ids [B, T], most sequences
        per row) -> [B, T, E]; key: LoRA dropout (None: none)."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_proj(x, _key(key, 0)).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x, _key(key, 1)).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x, _key(key, 2)).reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q = self.constrain(q, ("batch", "length", "heads", None))
        out = attend(
            q,
            k,
            v,
            segments[0],
            scale=c.head_dim**-0.5,
            implementation=self.implementation,
            slots=segments[1],
        )
        out = checkpoint_name(out, recompute.ATTENTION_OUT)
        return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim), _key(key, 3))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self,
        c: TransformerConfig,
        dtype: Any,
        rngs: nnx.Rngs,
        constrain: Constrain,
        lora: Any = None,
    ):
        e, m = c.hidden_size, c.intermediate_size

        def proj(name, d_in, d_out):
            return Linear(
                d_in, d_out, bias=c.mlp_bias, dtype=dtype, rngs=rngs, lora=_adapted(lora, name)
            )

        self.gate_proj = proj("gate_proj", e, m)
        self.up_proj = proj("up_proj", e, m)
        self.down_proj = proj("down_proj", m, e)
        self.constrain = constrain

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x, _key(key, 4))) * self.up_proj(x, _key(key, 5))
        return self.down_proj(self.constrain(h, ("batch", "length", "mlp")), _key(key, 6))


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        c: TransformerConfig,
        dtype: Any,
        rngs: nnx.Rngs,
        constrain: Constrain,
        attn: str,
        lora: Any = None,
    ):
        self.self_attn = Attention(c, dtype, rngs, constrain, attn, lora)
        self.mlp = MLP(c, dtype, rngs, constrain, lora)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def __call__(self, x, cos, sin, segments, key=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments, key)
        return x + self.mlp(self.post_attention_layernorm(x), key)


class Backbone(nnx.Module):
    """HF's ``model``: embeddings, decoder layers, final norm -> hidden states [B, T, E]."""

    def __init__(
        self,
        c: TransformerConfig,
        dtype: Any,
        rngs: nnx.Rngs,
        constrain: Constrain,
        remat: str | None,
        attn: str,
        lora: Any = None,
        remat_budget: float = 1.0,
    ):
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype, rngs)
        self.layers = nnx.List(
            [DecoderLayer(c, dtype, rngs, constrain, attn, lora) for _ in range(c.num_layers)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        inv_freq, scale = rope_inv_freq(c)
        self.inv_freq, self.rope_scale = tuple(inv_freq.tolist()), scale
        self.constrain, self.remat, self.remat_budget = constrain, remat, remat_budget

    def __call__(self, input_ids, segment_ids, position_ids, slots: int = 1, key=None) -> jax.Array:
        """input_ids, segment_ids (or attention_mask), position_ids [B, T] int -> hidden
        [B, T, E]; ``slots``: most sequences in one row (static); ``key``: LoRA dropout
        (None: none)."""
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        angles = position_ids.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
        angles = jnp.concatenate([angles, angles], axis=-1)
        cos, sin = jnp.cos(angles) * self.rope_scale, jnp.sin(angles) * self.rope_scale
        segments = (segment_ids.astype(jnp.int32), slots)
        x = self.constrain(self.embed_tokens(input_ids), ("batch", "length", None))
        for i, layer in enumerate(self.layers):
            k = _key(key, i)
            remat, policy = recompute.layer_remat(
                self.remat, self.remat_budget, i, len(self.layers)
            )
            if remat:  # gradient checkpointing: keep what the policy saves
                call = lambda lyr, h, k=k: lyr(h, cos, sin, segments, k)  # noqa: E731
                x = nnx.remat(call, policy=policy)(layer, x)
            else:
                x = layer(x, cos, sin, segments, k)
            x = self.constrain(x, ("batch", "length", None))
        return self.norm(x)


class CausalLM(nnx.Module):
    """Backbone + output heads. ``lm_head`` (absent when tied: logits use the embedding
    matrix, as HF) and/or ``score``, a ``[1, E]`` value head (HF's
    ``*ForTokenClassification`` / ``*ForSequenceClassification`` name) for critics and
    reward models. ``with_lm_head=False`` builds a critic/reward model without logits.
    ``attention``: ``xla``, ``cudnn`` or ``auto`` (``attention.resolve``). ``remat``: None
    (no activation checkpointing) or a ``ModelConfig.checkpoint_policy`` ("full",
    "selective", "budget" of ``remat_budget``: ``recompute.layer_remat``), applied to the
    decoder layers. ``lora``: a
    ``polyrl.config.LoraConfig`` puts LoRA adapters on its target projections
    (:class:`Linear`)."""

    def __init__(
        self,
        c: TransformerConfig,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
        with_lm_head: bool = True,
        with_value_head: bool = False,
        constrain: Constrain | None = None,
        remat: str | None = None,
        attention: str = "xla",
        lora: Any = None,
        remat_budget: float = 1.0,
    ):
        constrain = constrain or _no_constraint
        self.model = Backbone(c, dtype, rngs, constrain, remat, attention, lora, remat_budget)
        self.lm_head = (
            Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype, rngs=rngs)
            if with_lm_head and not c.tie_word_embeddings
            else None
        )
        self.score = (
            Linear(
                c.hidden_size,
                1,
                bias=False,
                dtype=dtype,
                rngs=rngs,
                init=nnx.initializers.zeros_init(),
            )
            if with_value_head
            else None
        )
        self.config, self.with_lm_head = c, with_lm_head

    def __call__(self, input_ids, segment_ids, position_ids, slots: int = 1, key=None) -> jax.Array:
        return self.model(input_ids, segment_ids, position_ids, slots, key)

    def head_weight(self) -> jax.Array:
        """The LM head as [V, E]: ``lm_head.weight``, or the embedding when tied."""
        if not self.with_lm_head:
            raise ValueError("this model was built without an LM head (a critic/reward model)")
        if self.lm_head is not None:
            return self.lm_head.weight[...]
        return self.model.embed_tokens.weight[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> fp32 logits [..., V] (:func:`_head_logits`)."""
        return _head_logits(hidden, self.head_weight())

    def token_scores(
        self,
        hidden: jax.Array,
        ids: jax.Array,
        temperature: jax.Array | float,
        *,
        entropy: bool,
        vocab: int | None = None,
        chunk_tokens: int = 1024,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Log-probs of ``ids`` [B, T] (and entropy) under ``softmax(logits(hidden[B, T, E])
        [..., :vocab] / temperature)``, fused with the LM head in chunks of about
        ``chunk_tokens`` tokens (all rows x a slice of positions, so the batch axis keeps its
        sharding): a ``lax.map`` over chunks whose body is rematerialised
        (``jax.checkpoint``), so one chunk's fp32 logits exist at a time, in the forward and
        in the backward pass. Returns ([B, T], [B, T] or None)."""
        b, t, _ = hidden.shape
        step = max(1, min(t, chunk_tokens // b))
        pad = (-t) % step

        def chunked(x):  # [B, T, ...] -> [T' / step, B, step, ...]
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            return jnp.moveaxis(x.reshape(b, -1, step, *x.shape[2:]), 1, 0)

        @jax.checkpoint
        def chunk(w, x):
            logits = _head_logits(x[0], w) / temperature
            lp, ent = log_probs_and_entropy(logits, x[1], entropy)
            return lp, ent if entropy else jnp.zeros_like(lp)

        weight = self.head_weight()[:vocab]
        xs = (chunked(hidden), chunked(ids.astype(jnp.int32)))
        lp, ent = jax.lax.map(lambda x: chunk(weight, x), xs)
        unchunk = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, -1)[:, :t]  # noqa: E731
        return unchunk(lp), unchunk(ent) if entropy else None

    def values(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> scalar head [...] (fp32)."""
        return _matmul_t(hidden, self.score.weight[...], jnp.float32)[..., 0]
