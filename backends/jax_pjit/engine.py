"""JaxPjitEngine: the TrainEngine of the JAX backend (Flax NNX + optax + orbax on a Mesh).

One engine holds one role's model on all devices of one host, arranged as the
``ParallelConfig`` mesh (data, fsdp, tensor). Parameters are a flat dict
``{path: jax.Array}`` (NNX paths = HF names, see ``weights.py``) sharded by the logical-axis
rules; every step is a ``jax.jit`` with explicit in/out shardings (pjit semantics).

``train_step`` pads the batch to a few padded shapes (``shapes.py``), runs one jitted
grad step per micro-batch that adds into a donated fp32 gradient buffer, then one
jitted update: pre-clip global norm, torch-style clip (``max_norm / (norm + 1e-6)``),
AdamW with torch.optim.AdamW's semantics (decoupled decay ``p -= lr * wd * p``, bias
correction, ``eps`` outside the square root) and the learning rate of
``OptimConfig.lr_at(step)`` read from a precomputed table.

Per-token outputs (``[B, R]``, zero where ``response_mask`` is 0):
``log_probs = log_softmax(logits / temperature)[response token]`` and ``entropy`` of
the same distribution for LM roles; ``values`` for value-head roles, where
``values[:, t]`` is the head at position ``P - 1 + t`` -- the state *before* response
token ``t`` is generated, aligned with ``log_probs[:, t]`` (verl's convention). The
Value-head roles also return ``scores`` [B]: the head at each row's last real token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from polyrl import checkpoints, faults, micro_batch
from polyrl.backends import exchange
from polyrl.backends.base import Bucket, LossContext, LossFn, check_temperature
from polyrl.backends.jax_pjit import (
    attention,
    checkpoint,
    distributed,
    gpu_memory,
    lora,
    sharding,
)
from polyrl.backends.jax_pjit.models import CausalLM, TransformerConfig
from polyrl.backends.jax_pjit.shapes import (
    REQUIRED,
    micro_rows,
    pack_rows,
    pad_batch,
    padded_cost,
)
from polyrl.backends.jax_pjit.weights import export_buckets, load_hf_params, read_hf_config
from polyrl.batch import Batch
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

__all__ = ["JaxPjitEngine", "adamw"]

log = logging.getLogger(__name__)

TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by (norm + 1e-6)


def adamw(optim: OptimConfig) -> optax.GradientTransformation:
    """optax AdamW at unit learning rate: ``u = -(m_hat / (sqrt(v_hat) + eps) + wd * p)``.

    The engine applies ``p += lr * u`` with ``lr = optim.lr_at(step)`` passed into the
    jitted update, which is torch.optim.AdamW's ``p *= 1 - lr * wd; p -= lr * m_hat /
    (sqrt(v_hat) + eps)`` expanded; the schedule is therefore exactly ``lr_at``'s, and
    (as in torch) it follows the engine's step even when a non-finite update is skipped
    and Adam's own count (bias correction) does not advance.
    """
    b1, b2 = optim.betas
    return optax.adamw(
        1.0, b1=b1, b2=b2, eps=optim.eps, eps_root=0.0, weight_decay=optim.weight_decay
    )


def _mask_pad_rows(batch: Batch) -> Batch:
    """Zero ``response_mask`` on rows ``Batch.pad_to_multiple`` marked ``is_pad``, so they
    count in no normaliser and (with a loss that masks) contribute nothing."""
    mask = batch["response_mask"].astype(np.float32)
    if "is_pad" in batch:
        mask = mask * (1 - batch["is_pad"].astype(np.float32))[:, None]
    return batch.with_columns({"response_mask": mask})


class JaxPjitEngine:
    """TrainEngine on a JAX device mesh (see module docstring).

    min_padded_len: smallest padded prompt/response length (lengths are padded to powers
      of two >= this); devices: the devices of the mesh (default ``jax.devices()``);
    ``compile_count``: number of jitted-function compilations so far (each is logged).
    """

    def __init__(self, *, min_padded_len: int = 16, devices: list | None = None):
        self.min_padded_len, self._devices = min_padded_len, devices
        self.compile_count = 0
        self.step = 0
        self.opt_state = None
        self._pending: Any = None  # gradients forward_backward accumulated (optim_step)
        self._host: dict[str, Any] | None = None
        self._jits: dict[Any, Any] = {}

    # --------------------------------------------------------------------- setup
    def init(self, model: ModelConfig, optim: OptimConfig | None, parallel: ParallelConfig) -> None:
        if model.trainable != (optim is not None):
            raise ValueError(
                f"role {model.role!r} got optim={optim!r}: actor/critic need an OptimConfig, "
                "reference/reward are frozen and need optim=None"
            )
        distributed.initialize_from_env()  # several hosts: join them before any device use
        if parallel.pack_sequences and jax.process_count() > 1:
            raise ValueError(
                f"ParallelConfig.pack_sequences=True: packed rows differ between the "
                f"{jax.process_count()} hosts of a multi-host JAX role; set it to False"
            )
        self.model_cfg, self.optim, self.parallel = model, optim, parallel
        self.mesh = sharding.make_mesh(parallel, self._devices)
        gpu_memory.keep(self.mesh.devices.flat)
        self.config = TransformerConfig.from_hf(
            read_hf_config(model.path), where=f"{model.path}/config.json"
        )
        self.with_lm = not model.has_value_head
        # trainable roles keep fp32 master weights and compute in model.dtype (as torch_fsdp)
        self.compute_dtype = jnp.dtype(model.dtype)
        first = self.mesh.devices.flat[0]
        self.attention = attention.resolve(
            model.attn_implementation,
            first.platform,
            self.compute_dtype,
            probe=(first, self.config.num_heads, self.config.num_kv_heads, self.config.head_dim),
        )
        # A LoRA actor keeps its frozen base in the compute dtype and fp32 adapters.
        dtype = jnp.dtype(jnp.float32) if model.trainable and not model.lora else self.compute_dtype

        def build(adapters):
            return CausalLM(
                self.config,
                dtype=dtype,
                rngs=nnx.Rngs(0),
                with_lm_head=self.with_lm,
                with_value_head=model.has_value_head,
                constrain=sharding.ActivationSharding(self.mesh, parallel.rules),
                remat=model.checkpoint_policy if model.gradient_checkpointing else None,
                remat_budget=model.activation_memory_budget,
                attention=self.attention,
                lora=adapters,
            )

        # The model with its adapters (True) and without (False: the base model, LoRA's
        # reference); both name the base weights alike.
        self._graphdefs = {}
        self._graphdefs[True], abs_state = nnx.split(nnx.eval_shape(lambda: build(model.lora)))
        self._graphdefs[False] = (
            nnx.split(nnx.eval_shape(lambda: build(None)))[0]
            if model.lora
            else self._graphdefs[True]
        )
        flat = list(abs_state.flat_state())
        self._paths = {".".join(map(str, p)): p for p, _ in flat}
        shapes = {".".join(map(str, p)): v.shape for p, v in flat}
        base, adapters = lora.split(shapes)
        host = load_hf_params(model.path, self.config, base, model.value_head_path)
        # Trained params (all, or LoRA's adapters) and frozen ones (LoRA's base; else none).
        trained, frozen = (adapters, base) if model.lora else (shapes, {})
        host |= {
            k: v.astype(jnp.float32) for k, v in lora.init_adapters(adapters, model.lora).items()
        }
        self.param_shardings = sharding.param_shardings(trained, self.mesh, parallel.rules)
        self.frozen_shardings = sharding.param_shardings(frozen, self.mesh, parallel.rules)
        self.params = {
            k: jax.device_put(host[k].astype(jnp.float32 if model.lora else dtype), s)
            for k, s in self.param_shardings.items()
        }
        self.frozen = {
            k: jax.device_put(host[k].astype(dtype), s) for k, s in self.frozen_shardings.items()
        }
        self._rep = sharding.replicated(self.mesh)
        self._rows = sharding.batch_sharding(self.mesh, parallel.rules, 1)
        if optim is not None:
            self.tx = adamw(optim)
            self._opt_shardings = self._optimizer_shardings()
            self.opt_state = self._jit("opt_init", self.tx.init, out_shardings=self._opt_shardings)(
                self.params
            )
        else:
            self.tx = None
        log.info(
            "jax_pjit %s: %s on mesh %s, %s attention, %d params",
            model.role,
            self.config.architecture,
            dict(self.mesh.shape),
            self.attention,
            sum(int(np.prod(s)) for s in shapes.values()),
        )

    def _optimizer_shardings(self) -> Any:
        """Optimizer-state leaves under a parameter's name (Adam moments) share its
        sharding; the rest (step counts) are replicated."""

        def pick(path, _):
            names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
            return next(
                (self.param_shardings[n] for n in names if n in self.param_shardings), self._rep
            )

        return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(self.tx.init, self.params))

    def _jit(self, key: Any, fn, **kw):
        """``jax.jit(fn, **kw)`` cached under ``key``; every trace bumps compile_count."""
        if key not in self._jits:
            name = key if isinstance(key, str) else key[0]

            def counted(*args):  # runs only while tracing, i.e. once per compilation
                self.compile_count += 1
                log.info("jax_pjit: compiling %s (compilation #%d)", name, self.compile_count)
                return fn(*args)

            self._jits[key] = jax.jit(counted, **kw)
        return self._jits[key]

    # ------------------------------------------------------------------ compute
    def _module(self, frozen, params, adapters: bool = True) -> CausalLM:
        """The model over ``frozen`` + ``params`` in the compute dtype; ``adapters=False``
        leaves LoRA's adapters out (the base model)."""
        merged = {**frozen, **params}
        if not adapters:
            merged = {k: v for k, v in merged.items() if not lora.is_adapter(k)}
        state = nnx.State.from_flat_path(
            {self._paths[k]: v.astype(self.compute_dtype) for k, v in merged.items()}
        )
        return nnx.merge(self._graphdefs[adapters], state)

    def _hidden(self, model: CausalLM, arrays, key=None) -> tuple[jax.Array, jax.Array]:
        """(hidden [B, R, E] at the positions predicting each response token, hidden [B, E]
        at each sample's last real token) of a padded or packed (``pack_rows``)
        micro-batch."""
        b, r = arrays["responses"].shape
        if "packed_ids" in arrays:
            rows = arrays["packed_ids"].shape[0]
            hidden = model(
                arrays["packed_ids"],
                arrays["packed_segments"],
                arrays["packed_positions"],
                b // rows,
                key,
            )
            pick = lambda index: jnp.take_along_axis(  # noqa: E731
                hidden, index.reshape(rows, -1)[..., None], axis=1
            )
            return pick(arrays["packed_index"]).reshape(b, r, -1), pick(
                arrays["packed_last"]
            ).reshape(b, -1)
        ids, attn = arrays["input_ids"], arrays["attention_mask"]
        hidden = model(ids, attn, arrays["position_ids"], 1, key)
        p = ids.shape[1] - r
        last = ids.shape[1] - 1 - jnp.argmax(attn[:, ::-1] != 0, axis=1)
        # position P-1+t predicts responses[:, t]
        return hidden[:, p - 1 : p - 1 + r], hidden[jnp.arange(b), last]

    def _outputs(
        self, frozen, params, arrays, temperature, entropy: bool, adapters=True, key=None
    ) -> dict[str, jax.Array]:
        """Per-token outputs [B, R] of one (padded or packed) micro-batch; see module
        docstring. ``key``: LoRA dropout (training only)."""
        model = self._module(frozen, params, adapters)
        h, last_hidden = self._hidden(model, arrays, key)
        keep = arrays["response_mask"] != 0
        out = {}
        if self.with_lm:
            # Only the ids the rollout can sample (ModelConfig.sampling_vocab_size).
            lp, ent = model.token_scores(
                h,
                arrays["responses"],
                temperature,
                entropy=entropy,
                vocab=self.model_cfg.sampling_vocab_size,
                chunk_tokens=self.parallel.logits_chunk_tokens,
            )
            out["log_probs"] = jnp.where(keep, lp, 0.0)
            if entropy:
                out["entropy"] = jnp.where(keep, ent, 0.0)
        else:
            out["values"] = jnp.where(keep, model.values(h), 0.0)
            out["scores"] = model.values(last_hidden)
        return out

    def _micro_batches(
        self, batch: Batch, trim: bool = False
    ) -> list[tuple[np.ndarray, dict[str, jax.Array]]]:
        """(row indices, padded global micro-batch) pairs: ``polyrl.micro_batch``'s groups,
        padded by shapes.py. Fixed ``micro_batch_size`` rows in order: each padded to the
        whole batch's shape (one program for all of them; what a run's warm-up compiles),
        or with ``trim`` each trimmed to its own rows' lengths first, as torch trims each
        micro-batch (short rows cost short-row compute, at one program per distinct
        shape). Token budget (``max_tokens_per_micro_batch`` per data shard, whose cost
        counts the padded shape: ``shapes.padded_cost``): always trimmed.
        ``pack_sequences``: each padded micro-batch's sequences packed into one row per
        data shard (``shapes.pack_rows``).

        With several hosts (distributed.py) ``batch`` is this host's shard (fixed
        micro-batches only): the hosts agree on the number of micro-batches and each one's
        lengths, so every host pads to the same shapes and feeds its rows (maybe none) of
        each global micro-batch."""
        par = self.parallel
        if par.max_tokens_per_micro_batch is None:
            size = int(distributed.agree([len(batch)], "max")[0])
            rows = micro_rows(size, par.micro_batch_size, par.dp_size // jax.process_count())
            groups = [
                (np.arange(min(i, len(batch)), min(i + rows, len(batch))), rows)
                for i in range(0, size, rows)
            ]
        else:
            if jax.process_count() > 1:
                raise ValueError(
                    f"ParallelConfig.max_tokens_per_micro_batch={par.max_tokens_per_micro_batch}: "
                    f"token-budget micro-batches differ between the {jax.process_count()} hosts "
                    "of a multi-host JAX role; use a fixed micro_batch_size (set it to None)"
                )
            budget = par.max_tokens_per_micro_batch * par.dp_size
            cost = padded_cost(par.dp_size, self.min_padded_len, par.pack_sequences)
            groups = [
                (idx, micro_rows(len(idx), len(idx), par.dp_size))
                for idx in micro_batch.plan(batch, par.micro_batch_size, budget, cost=cost)
            ]
            trim = True
        parts = [batch.take(idx) for idx, _ in groups]
        if trim:
            parts = [micro_batch.trim(part) for part in parts]
        r = [part["responses"].shape[1] for part in parts]
        agreed = distributed.agree(
            [[part["input_ids"].shape[1] - n, n] for part, n in zip(parts, r)], "max"
        )
        out = []
        for (idx, rows), part, (p, n) in zip(groups, parts, agreed):
            arrays = pad_batch(part, rows, self.min_padded_len, at_least=(rows, p, n)).arrays
            if par.pack_sequences:
                arrays = pack_rows(arrays, par.dp_size, self.min_padded_len)
            out.append(
                (idx, {k: distributed.global_rows(self._rows, v) for k, v in arrays.items()})
            )
        return out

    def forward(
        self,
        batch: Batch,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        adapters: bool = True,
    ) -> dict[str, np.ndarray]:
        fn = self._forward_fn(entropy, adapters)
        self._check_loaded()
        check_temperature(temperature)
        temp = jnp.float32(temperature)
        # the model's columns alone: the program's inputs do not change with what else
        # the batch holds (rewards, advantages, ... added between two forwards of a step)
        parts = [
            (idx, jax.tree.map(distributed.local_rows, fn(self.frozen, self.params, c, temp)))
            for idx, c in self._micro_batches(batch.select(*REQUIRED))
        ]
        return micro_batch.scatter(parts, *batch["responses"].shape)

    def _forward_fn(self, entropy: bool, adapters: bool):
        adapters = adapters or self.model_cfg.lora is None
        return self._jit(
            ("forward", entropy, adapters),
            lambda frozen, params, arrays, temp: self._outputs(
                frozen, params, arrays, temp, entropy, adapters
            ),
            in_shardings=(self.frozen_shardings, self.param_shardings, self._rows, self._rep),
            out_shardings=self._rows,
        )

    # ----------------------------------------------------------------- training
    def _grad_step(self, loss_fn: LossFn, entropy: bool, keep: bool = False):
        """One micro-batch's gradients added to ``grads``; with ``keep`` the program also
        returns its ``log_probs`` (``forward_backward``)."""

        def step(frozen, params, grads, arrays, counts, temperature, key):
            def objective(p):
                ctx = LossContext(
                    global_tokens=counts[0], global_seqs=counts[1], temperature=temperature
                )
                out = self._outputs(frozen, p, arrays, temperature, entropy, key=key)
                loss, metrics = loss_fn(out, arrays, ctx)
                return loss, (metrics, out["log_probs"] if keep else None)

            (loss, (metrics, log_probs)), g = jax.value_and_grad(objective, has_aux=True)(params)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return (grads, loss, metrics, log_probs) if keep else (grads, loss, metrics)

        ps = self.param_shardings
        outs = (ps, self._rep, self._rep) + ((self._rows,) if keep else ())
        return self._jit(
            ("grad_step", loss_fn, entropy, keep),
            step,
            in_shardings=(
                self.frozen_shardings,
                ps,
                ps,
                self._rows,
                self._rep,
                self._rep,
                self._rep,
            ),
            out_shardings=outs,
            donate_argnums=(2,),
        )

    def _apply_step(self, optim: OptimConfig | None = None):
        """The jitted update with ``optim``'s hyper-parameters (default: the engine's own):
        another AdamW's betas, eps or weight decay act on the same optimizer state."""
        optim = optim or self.optim
        clip = optim.grad_clip
        tx = self.tx if optim == self.optim else adamw(optim)

        def update(params, opt_state, grads, norm, lr):
            if clip is not None:
                coef = jnp.minimum(1.0, clip / (norm + TORCH_CLIP_EPS))
                grads = jax.tree.map(lambda g: g * coef, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return jax.tree.map(
                lambda p, u: (p + lr * u).astype(p.dtype), params, updates
            ), opt_state

        def apply(params, opt_state, grads, lr, loss_ok):
            norm = optax.global_norm(grads)
            # a non-finite loss or gradient skips the update (torch_fsdp does the same)
            ok = jnp.isfinite(norm) & loss_ok
            params, opt_state = jax.lax.cond(
                ok,
                update,
                lambda p, o, *_: (p, o),
                params,
                opt_state,
                grads,
                norm,
                lr,
            )
            return params, opt_state, norm, ok

        ps, os_ = self.param_shardings, self._opt_shardings
        return self._jit(
            ("apply_step", optim.betas, optim.eps, optim.weight_decay, clip),
            apply,
            in_shardings=(ps, os_, ps, self._rep, self._rep),
            out_shardings=(ps, os_, self._rep, self._rep),
            donate_argnums=(0, 1),
        )

    def _zero_grads(self):
        return self._jit(
            "zero_grads",
            lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p),
            out_shardings=self.param_shardings,
        )

    def warm_up(self, method: str, batch: Batch, *args, **kwargs) -> None:
        """Lower and compile ahead (``jit(...).lower(...).compile()``) every program
        ``method`` runs on ``batch``: its micro-batches' padded shapes and, for
        "train_step", the gradient zeroing and the optimizer's apply. Nothing runs, so no
        activation memory and no state change; the call itself then finds each program in
        JAX's caches (the persistent one too, across runs)."""
        self._check_loaded()
        temp = jnp.float32(kwargs.get("temperature", 1.0))
        if method == "forward":
            batch = batch.select(*REQUIRED)
        shapes = {}  # one compilation per distinct micro-batch shape
        for _, chunk in self._micro_batches(batch):
            shapes.setdefault(tuple((k, v.shape, v.dtype.name) for k, v in chunk.items()), chunk)
        if method == "forward":
            fn = self._forward_fn(kwargs.get("entropy", False), kwargs.get("adapters", True))
            for chunk in shapes.values():
                fn.lower(self.frozen, self.params, chunk, temp).compile()
            return
        if method != "train_step":
            raise ValueError(f"warm_up: {method!r} is not 'forward' or 'train_step'")
        if self.tx is None:
            raise RuntimeError(f"warm_up: the frozen {self.model_cfg.role!r} role does not train")
        (loss_fn,) = args
        grads = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=s),
            self.params,
            self.param_shardings,
        )
        self._zero_grads().lower(self.params).compile()
        step = self._grad_step(loss_fn, kwargs.get("entropy", False))
        counts = jax.device_put(np.ones(2, np.float32), self._rep)
        for chunk in shapes.values():
            step.lower(
                self.frozen, self.params, grads, chunk, counts, temp, self._dropout_key(0)
            ).compile()
        self._apply_step().lower(
            self.params, self.opt_state, grads, jnp.float32(0.0), jnp.bool_(True)
        ).compile()

    def _dropout_key(self, micro: int) -> jax.Array | None:
        """LoRA dropout's key for micro-batch ``micro`` of this update: a function of the
        step, so a resumed run draws the same masks (no RNG state to checkpoint)."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), self.step), micro)
        return jax.device_put(key, self._rep)

    def _inject_faults(self, grads: dict[str, jax.Array], loss: float) -> tuple[Any, float]:
        """Test-only (``polyrl.faults``): NaN loss and/or gradients in this update."""
        nan_loss = faults.active("nan_loss", self.step, self.model_cfg.role)
        if nan_loss or faults.active("nan_grad", self.step, self.model_cfg.role):
            first = next(iter(grads))
            grads = {**grads, first: grads[first] * jnp.nan}
        return grads, loss + float("nan") if nan_loss else loss

    def _check_trainable(self, what: str) -> None:
        if self.tx is None:
            raise RuntimeError(
                f"{what} on the frozen {self.model_cfg.role!r} role: it was built with "
                "optim=None and has no optimizer; train an 'actor' or 'critic' instead"
            )
        self._check_loaded()

    @staticmethod
    def _counts(batch: Batch) -> np.ndarray:
        """[valid tokens, sequences with one] over every host's rows."""
        mask = batch["response_mask"]
        counts = np.array([mask.sum(), (mask.sum(axis=1) > 0).sum()], np.float32)
        return distributed.agree(counts, "sum")

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0
    ) -> dict[str, Any]:
        """Gradients of ``loss_fn`` on ``batch`` added to those pending since the last
        :meth:`optim_step` (see ``TrainEngine``): ``log_probs`` [B, R] and the loss's and
        metrics' sums. Each micro-batch is trimmed to its own rows' lengths (``trim``
        of :meth:`_micro_batches`): this call has no warm-up and gets batches of any
        lengths (the Tinker service's datums, each call its own)."""
        self._check_trainable("forward_backward")
        check_temperature(temperature)
        counts = jax.device_put(self._counts(batch), self._rep)
        step = self._grad_step(loss_fn, entropy=False, keep=True)
        grads = self._pending if self._pending is not None else self._zero_grads()(self.params)
        parts, sums, temp = [], [], jnp.float32(temperature)
        for i, (idx, chunk) in enumerate(self._micro_batches(batch, trim=True)):
            grads, loss, metrics, log_probs = step(
                self.frozen, self.params, grads, chunk, counts, temp, self._dropout_key(i)
            )
            parts.append((idx, {"log_probs": distributed.local_rows(log_probs)}))
            sums.append((loss, metrics))
        self._pending = grads
        sums = jax.device_get(sums)
        out: dict[str, Any] = {"loss": float(sum(np.float64(lo) for lo, _ in sums))}
        for name in sums[0][1]:
            out[name] = float(sum(np.float64(m[name]) for _, m in sums))
        scattered = micro_batch.scatter(parts, *batch["responses"].shape)
        return {"log_probs": scattered["log_probs"], **out}

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and step count and any pending gradients (a fresh
        optimizer on the current weights; ``step`` stays)."""
        self._check_trainable("reset_optimizer")
        self._pending = None
        self.opt_state = self._jit("opt_init", self.tx.init, out_shardings=self._opt_shardings)(
            self.params
        )

    def optim_step(self, optim: OptimConfig) -> dict[str, float]:
        """One AdamW update from the gradients :meth:`forward_backward` accumulated, with
        ``optim``'s hyper-parameters; the pending gradients are cleared."""
        self._check_trainable("optim_step")
        grads = self._pending if self._pending is not None else self._zero_grads()(self.params)
        self._pending = None
        lr = optim.lr_at(self.step)
        self.params, self.opt_state, norm, _ = self._apply_step(optim)(
            self.params, self.opt_state, grads, jnp.float32(lr), jnp.bool_(True)
        )
        self.step += 1
        return {"grad_norm": float(norm), "lr": lr}

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0, entropy: bool = False
    ) -> dict[str, float]:
        self._check_trainable("train_step")
        check_temperature(temperature)
        batch = _mask_pad_rows(batch)
        counts = self._counts(batch)
        if counts[0] == 0:
            raise ValueError("train_step: response_mask sums to 0 (no response token to train on)")
        chunks = [chunk for _, chunk in self._micro_batches(batch)]
        step = self._grad_step(loss_fn, entropy)
        grads, parts = self._zero_grads()(self.params), []
        counts_dev, temp = jax.device_put(counts, self._rep), jnp.float32(temperature)
        for i, chunk in enumerate(chunks):
            key = self._dropout_key(i)
            grads, loss, metrics = step(
                self.frozen, self.params, grads, chunk, counts_dev, temp, key
            )
            parts.append((loss, metrics))
        parts = jax.device_get(parts)
        grads, loss = self._inject_faults(grads, float(sum(np.float64(lo) for lo, _ in parts)))
        lr = self.optim.lr_at(self.step)
        self.params, self.opt_state, norm, ok = self._apply_step()(
            self.params, self.opt_state, grads, jnp.float32(lr), jnp.bool_(np.isfinite(loss))
        )
        if not bool(ok):
            log.warning(
                "%s update %d: non-finite loss %s or grad norm %s, update skipped",
                self.model_cfg.role,
                self.step,
                loss,
                norm,
            )
        self.step += 1
        out = {
            "loss": loss,
            "grad_norm": float(norm),
            "lr": lr,
            "global_tokens": float(counts[0]),
            "global_seqs": float(counts[1]),
            "nonfinite_skipped": float(not bool(ok)),
        }
        for name in parts[0][1]:
            out[name] = float(sum(np.float64(m[name]) for _, m in parts))
        return out

    # ---------------------------------------------------------- weights & state
    def export_weights(self, bucket_bytes: int, trained_only: bool = False) -> Iterator[Bucket]:
        self._check_loaded()
        if self.model_cfg.lora is None:
            return export_buckets(self.params, bucket_bytes, dtype=self.compute_dtype)
        weights = lora.merged({**self.frozen, **self.params}, self.model_cfg.lora.scale)
        if trained_only:
            weights = ((n, w) for n, w in weights if self.model_cfg.lora.changes(n))
        return export_buckets(weights, bucket_bytes, dtype=self.compute_dtype)

    def save_adapters(self, path: str) -> None:
        """The LoRA adapters as a PEFT adapter directory (the first host writes)."""
        self._check_loaded()
        if self.model_cfg.lora is None:
            raise ValueError(
                "save_adapters: this engine has no LoRA adapters (ModelConfig.lora is None)"
            )
        buckets = export_buckets(self.params, 1 << 30, dtype=jnp.float32)
        arrays = {k: np.asarray(v) for bucket in buckets for k, v in bucket}
        if jax.process_index() == 0:
            checkpoints.save_peft_adapters(path, arrays, self.model_cfg.lora, self.model_cfg.path)

    def set_weights(self, named: dict[str, np.ndarray]) -> None:
        """Replace every weight with full arrays under HF names (another engine's)."""
        self._check_loaded()
        missing = sorted(set(self.params) - set(named))
        if missing:
            raise ValueError(
                f"no weights given for {len(missing)} parameter(s), e.g. {missing[:3]}"
            )
        self.params = {
            k: jax.device_put(np.asarray(named[k]).astype(v.dtype), self.param_shardings[k])
            for k, v in self.params.items()
        }

    def _state(self) -> dict[str, Any]:
        state = {
            "params": self.params,
            "step": jax.device_put(np.int32(self.step), self._rep),
        }
        if self.opt_state is not None:
            state["opt_state"] = self.opt_state
        return state

    def save(self, path: str) -> None:
        self._check_loaded()
        checkpoint.save_state(
            path,
            self._state(),
            {"step": self.step, "mesh": dict(self.parallel.mesh), **self._identity()},
        )

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must match to load into this engine (role, model shape, LoRA)."""
        lora_cfg = self.model_cfg.lora
        return {
            "role": self.model_cfg.role,
            "model": checkpoints.model_shape(self.model_cfg.path),
            **({"lora": lora_cfg.manifest()} if lora_cfg else {}),
        }

    def load(self, path: str) -> None:
        """Restore :meth:`save`'s checkpoint, or an exchange directory another backend's
        checkpoint was converted into (``polyrl.backends.exchange``)."""
        self._check_loaded()
        if exchange.is_exchange(path):
            checkpoints.check_manifest(exchange.read_info(path), self._identity(), path)
            state = exchange.read(path, set(self.params))
            if self.opt_state is not None and not state.moments:
                raise ValueError(f"exchange checkpoint {path} has no optimizer state to train from")
            self.set_weights(state.params)
            if self.opt_state is not None:
                self.opt_state = jax.device_put(
                    checkpoint.opt_state_from_exchange(self.opt_state, state), self._opt_shardings
                )
            self.step = state.step
            return
        checkpoints.check_manifest(checkpoint.read_info(path), self._identity(), path)
        state, _ = checkpoint.restore_state(path, checkpoint.abstract_like(self._state()))
        self.params = state["params"]
        self.opt_state = state.get("opt_state")
        self.step = int(state["step"])

    def offload(self) -> None:
        """Move parameters and optimizer state to host memory (pinned host memory where
        the platform has it, else numpy), free their device buffers and hand the memory
        pool's unused memory back to the GPU (``gpu_memory.release``)."""
        if self._host is not None:
            return
        tree = {"params": self.params, "opt_state": self.opt_state, "frozen": self.frozen}
        kinds = {m.kind for m in self.mesh.devices.flat[0].addressable_memories()}
        if "pinned_host" in kinds:
            self._host = jax.tree.map(
                lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), tree
            )
        else:
            self._host = jax.device_get(tree)
        jax.block_until_ready(self._host)
        for x in jax.tree.leaves(tree):
            x.delete()
        self.params = self.opt_state = self.frozen = None
        gpu_memory.release(self.mesh.devices.flat)

    def reload(self) -> None:
        if self._host is None:
            return
        self.params = {
            k: jax.device_put(v, self.param_shardings[k]) for k, v in self._host["params"].items()
        }
        self.frozen = {
            k: jax.device_put(v, self.frozen_shardings[k]) for k, v in self._host["frozen"].items()
        }
        if self._host["opt_state"] is not None:
            self.opt_state = jax.device_put(self._host["opt_state"], self._opt_shardings)
        self._host = None

    def _check_loaded(self) -> None:
        if self._host is not None:
            raise RuntimeError("the engine is offloaded; call reload() before using it")
