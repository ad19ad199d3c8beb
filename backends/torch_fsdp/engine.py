"""TorchFSDPEngine: a Hugging Face model under FSDP2 behind ``TrainEngine``.

One engine = one role's model on one rank. ``init`` loads the model (``models``), shards
it over the DeviceMesh built from ``ParallelConfig`` (``sharding``) and builds AdamW for
trainable roles; ``forward``/``train_step`` follow the loss contract of
``backends/base.py``; ``export_weights``/``save_hf`` gather HF-named full tensors
(``weights``); ``save``/``load`` are DCP checkpoints (``checkpoint``). With a
``tensor`` mesh axis the ranks of a tensor-parallel group gather their shards and compute
on the group's rows (``tensor_parallel``); each returns the outputs of its own rows.

Shapes: B samples on this rank, P prompt / R response tokens (``polyrl.batch``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import torch

from polyrl import checkpoints, faults, micro_batch
from polyrl.backends import exchange
from polyrl.backends.base import (
    ENGINES,
    Bucket,
    LossContext,
    LossFn,
    check_temperature,
    tensor_split_problem,
)
from polyrl.backends.torch_fsdp import (
    checkpoint,
    lora,
    models,
    sharding,
    tensor_parallel,
    weights,
)
from polyrl.batch import Batch
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

__all__ = ["TorchFSDPEngine", "MODEL_COLUMNS"]

log = logging.getLogger(__name__)

# Columns every forward/train_step needs (polyrl.batch's sequence layout).
MODEL_COLUMNS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
_LONG_COLUMNS = ("input_ids", "attention_mask", "position_ids", "responses")


class TorchFSDPEngine:
    """``TrainEngine`` on PyTorch FSDP2. Call :meth:`init` before anything else.

    Attributes after init: ``model`` (the sharded module), ``optimizer`` (None for frozen
    roles), ``tokenizer``, ``env`` (rank/world/device), ``step`` (optimizer updates done).
    """

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self.tp_mesh = None  # the tensor-parallel sub-mesh (None: no tensor parallelism)
        self._offloaded = False

    # ------------------------------------------------------------------ init
    def init(self, model: ModelConfig, optim: OptimConfig | None, parallel: ParallelConfig) -> None:
        """Load ``model.path``, shard it per ``parallel``, build AdamW from ``optim``."""
        if model.trainable and optim is None:
            raise ValueError(
                f"ModelConfig.role={model.role!r} trains, but optim is None; pass an OptimConfig"
            )
        if not model.trainable and optim is not None:
            raise ValueError(
                f"ModelConfig.role={model.role!r} is frozen (no optimizer); pass optim=None"
            )
        self.cfg, self.optim_cfg, self.parallel = model, optim, parallel
        self.env = sharding.init_distributed()
        compute_dtype = sharding.TORCH_DTYPES[model.dtype]
        # Trainable roles keep fp32 masters and let FSDP's mixed precision compute in
        # dtype; frozen roles are loaded in dtype directly.
        master = torch.float32 if model.trainable and model.lora is None else compute_dtype
        # First: a bad mesh fails before any weight is read.
        if parallel.mesh["tensor"] > 1:
            where = f"{model.role}/ParallelConfig.mesh"
            backend = ENGINES["torch_fsdp"]
            problem = (
                backend.compile_problem(model.compile, parallel.mesh["tensor"], where)
                or backend.lora_problem(model.lora, parallel.mesh["tensor"], where)
                or tensor_split_problem(
                    checkpoints.model_shape(models.check_path(model)),
                    parallel.mesh["tensor"],
                    where,
                )
            )
            if problem:
                raise ValueError(problem)
        plan = sharding.build_plan(
            parallel, self.env, compute_dtype if model.trainable else torch.float32
        )
        self.tp_mesh = plan.tp_mesh
        self.tokenizer = models.load_tokenizer(model)
        loaded = models.load_model(model, master, parallel.logits_chunk_tokens)
        self.hf_config = loaded.hf_config
        self.model = sharding.shard_model(loaded.module, plan, loaded.layer_classes)
        if model.trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=optim.lr_at(0),
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                # One kernel per step over all tensors, not a dozen foreach passes each
                # dispatched through DTensor (the H200 trace: 34 ms of GPU and ~20 ms of
                # host launches per 1.5B step went to the foreach AdamW).
                fused=True,
            )
        log.info(
            "torch_fsdp %s on %s: rank %d/%d, mesh %s",
            model.role,
            self.env.device,
            self.env.rank,
            self.env.world_size,
            parallel.mesh,
        )

    # --------------------------------------------------------------- helpers
    def _check_usable(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"TorchFSDPEngine.{what}: call init(model, optim, parallel) first")
        if self._offloaded:
            raise RuntimeError(
                f"TorchFSDPEngine.{what}: the {self.cfg.role} engine is offloaded; call reload() first"
            )

    def _check_trainable(self, what: str) -> None:
        self._check_usable(what)
        if self.optimizer is None:
            raise RuntimeError(
                f"TorchFSDPEngine.{what}: role {self.cfg.role!r} is frozen (no optimizer); "
                "only 'actor' and 'critic' engines train"
            )

    def _check_batch(self, batch: Batch, who: str) -> None:
        batch.require(*MODEL_COLUMNS, who=who)
        # Every rank must run the same number of micro-batches (each is a collective).
        sizes = sharding.all_reduce_sum(self._rank_onehot(len(batch)))
        if len(set(sizes.tolist())) > 1:
            raise ValueError(
                f"{who}: ranks hold different batch sizes {sizes.long().tolist()}; give every "
                "rank an equal shard (Batch.pad_to_multiple(world) then Batch.split(world))"
            )

    def _group_rows(self, batch: Batch) -> Batch:
        """The rows this rank computes on: its own shard, or with tensor parallelism the
        shards of its whole tensor-parallel group (``tensor_parallel.gather_rows``)."""
        if self.tp_mesh is None:
            return batch
        return tensor_parallel.gather_rows(batch, self.tp_mesh)

    def _rank_onehot(self, value: int) -> torch.Tensor:
        out = torch.zeros(self.env.world_size, dtype=torch.float64, device=self.env.device)
        out[self.env.rank] = value
        return out

    def _micro_batches(self, batch: Batch) -> list[tuple[np.ndarray, Batch]]:
        """(row indices, micro-batch with all-padding columns trimmed) pairs: fixed
        ``micro_batch_size`` rows or the token budget (``polyrl.micro_batch``; counting
        real tokens when packed, else the trimmed rows' padded ones). Every rank runs the
        same number (each micro-batch is a collective)."""
        par = self.parallel
        cost = micro_batch.real_tokens if par.pack_sequences else micro_batch.padded_tokens
        groups = micro_batch.plan(
            batch, par.micro_batch_size, par.max_tokens_per_micro_batch, cost=cost
        )
        count = int(sharding.all_reduce_sum(self._rank_onehot(len(groups))).max())
        return [
            (idx, micro_batch.trim(batch.take(idx))) for idx in micro_batch.split_to(groups, count)
        ]

    def _to_device(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Numeric columns as torch tensors on this rank's device (ids as int64)."""
        out = {}
        for name, col in batch.tensors.items():
            # Batches from Ray's object store are read-only views: copy before torch owns them.
            t = torch.from_numpy(np.array(col, copy=True, order="C")).to(self.env.device)
            out[name] = t.long() if name in _LONG_COLUMNS else t
        return out

    def _outputs(
        self, inputs: dict[str, torch.Tensor], temperature: float, entropy: bool
    ) -> dict[str, torch.Tensor]:
        check_temperature(temperature)
        if self.cfg.has_value_head:
            return models.value_outputs(self.model, inputs)
        return models.policy_outputs(
            self.model,
            inputs,
            temperature,
            entropy,
            self.cfg.sampling_vocab_size,
            pack=self.parallel.pack_sequences,
        )

    # --------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(
        self,
        batch: Batch,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        adapters: bool = True,
    ) -> dict[str, np.ndarray]:
        """No-grad outputs as numpy, micro-batched: ``log_probs`` [B, R] (+ ``entropy``) for
        actor/reference; ``values`` [B, R] and ``scores`` [B] for critic/reward.
        Zero where ``response_mask`` is 0. ``adapters=False``: a LoRA actor scores as its
        frozen base model (the run's reference)."""
        self._check_usable("forward")
        self._check_batch(batch, who="TorchFSDPEngine.forward")
        self.model.eval()
        rows = self._group_rows(batch.select(*MODEL_COLUMNS))
        parts = []
        base_only = self.cfg.lora is not None and not adapters
        for idx, mb in self._micro_batches(rows):
            with lora.adapters_off(self.model) if base_only else contextlib.nullcontext():
                outputs = self._outputs(self._to_device(mb), temperature, entropy)
            parts.append((idx, {k: v.float().cpu().numpy() for k, v in outputs.items()}))
        out = micro_batch.scatter(parts, *rows["responses"].shape)
        if self.tp_mesh is None:
            return out
        own = tensor_parallel.own_rows(self.tp_mesh, len(batch))
        return {k: v[own] for k, v in out.items()}

    # ------------------------------------------------------------ train_step
    def _loss_context(self, mask: np.ndarray, temperature: float) -> LossContext:
        local = torch.tensor(
            [mask.sum(), (mask.sum(axis=1) > 0).sum()], dtype=torch.float64, device=self.env.device
        )
        tokens, seqs = sharding.all_reduce_sum(local).tolist()
        return LossContext(global_tokens=tokens, global_seqs=seqs, temperature=temperature)

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0, entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer update on this rank's shard ``batch`` (see ``TrainEngine``).

        Rows with ``is_pad == 1`` get an all-zero ``response_mask`` before anything sees
        the batch, so they count in no normaliser and (for a loss that masks, as the
        contract requires) contribute nothing. A non-finite loss or gradient norm skips
        the update on every rank (see :meth:`_apply_update`); ``nonfinite_skipped`` is 1.
        """
        self._check_trainable("train_step")
        self._check_batch(batch, who="TorchFSDPEngine.train_step")
        mask = batch["response_mask"].astype(np.float32)
        if "is_pad" in batch:
            mask = mask * (1 - batch["is_pad"].astype(np.float32))[:, None]
        batch = batch.with_columns({"response_mask": mask})
        ctx = self._loss_context(mask, temperature)
        if ctx.global_tokens == 0:  # every rank sees the global count: all raise together
            raise ValueError(
                "train_step: response_mask sums to 0 on every rank (no response token to train on)"
            )
        return self._apply_update(self._gradients(batch, loss_fn, ctx, entropy), ctx)

    def _gradients(
        self,
        batch: Batch,
        loss_fn: LossFn,
        ctx: LossContext,
        entropy: bool,
        parts: list | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward and backward over ``batch``'s micro-batches, gradients accumulated in
        the parameters' ``grad``; the sums of the loss and its metrics. ``parts``: also
        collect each micro-batch's ``(row indices, {"log_probs": numpy})`` into it."""
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        with lora.seeded_dropout(self.cfg.lora, self.step, self.env.rank, self.env.device):
            for idx, mb in self._micro_batches(self._group_rows(batch)):
                inputs = self._to_device(mb)
                outputs = self._outputs(inputs, ctx.temperature, entropy)
                loss, metrics = loss_fn(outputs, inputs, ctx)
                loss.backward()
                if parts is not None:
                    log_probs = outputs["log_probs"].detach().float().cpu().numpy()
                    parts.append((idx, {"log_probs": log_probs}))
                for key, value in {"loss": loss, **metrics}.items():
                    value = torch.as_tensor(value, dtype=torch.float64).detach()
                    sums[key] = sums.get(key, 0) + value.to(self.env.device)
        return sums

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0
    ) -> dict[str, object]:
        """Gradients of ``loss_fn`` on ``batch`` added to the parameters' ``grad``, no
        optimizer step (see ``TrainEngine``): ``log_probs`` [B, R] (numpy) and the loss's
        and metrics' sums over every rank."""
        self._check_trainable("forward_backward")
        self._check_batch(batch, who="TorchFSDPEngine.forward_backward")
        mask = batch["response_mask"].astype(np.float32)
        ctx = self._loss_context(mask, temperature)
        rows = self._group_rows(batch)
        parts: list = []
        sums = self._gradients(batch, loss_fn, ctx, entropy=False, parts=parts)
        log_probs = micro_batch.scatter(parts, *rows["responses"].shape)["log_probs"]
        if self.tp_mesh is not None:
            log_probs = log_probs[tensor_parallel.own_rows(self.tp_mesh, len(batch))]
        return {"log_probs": log_probs, **self._totals(sums)}

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and step counts and any pending gradients (a fresh
        optimizer on the current weights; ``step`` stays)."""
        self._check_trainable("reset_optimizer")
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()

    def optim_step(self, optim: OptimConfig) -> dict[str, float]:
        """One AdamW update from the gradients :meth:`forward_backward` accumulated, with
        ``optim``'s hyper-parameters (its ``lr_at`` this update's rate, ``grad_clip``)."""
        self._check_trainable("optim_step")
        grad_norm, lr, _ = self._update(optim, loss_finite=True)
        return {"grad_norm": grad_norm, "lr": lr}

    def warm_up(self, method: str, batch: Batch, *args, **kwargs) -> None:
        """``torch.compile`` traces each compiled region on its first call and its graphs
        are shape-generic (``compiling``), so ``method`` on a few rows of ``batch``
        compiles what the whole batch will run: its longest sequence repeated (no
        padding) and, when the batch has padding, its shortest with the longest (a
        micro-batch with padding gets an attention mask from transformers, one without
        none: two graph families, and a step's micro-batches can be of both kinds). Two
        rows on a GPU, where a colocated vLLM is sizing its KV cache meanwhile; on a CPU
        as many as a real micro-batch, since inductor's C++ code guards its float sums
        on their size (over 4096 elements it sums with a helper: a micro-batch of more
        tokens compiled again). The gradients it makes are dropped and the RNG restored.
        An eager engine has nothing to prepare."""
        if not self.cfg.compile:
            return
        if method not in ("forward", "train_step"):
            raise ValueError(f"warm_up: {method!r} is not 'forward' or 'train_step'")
        cuda = self.env.device.type == "cuda"
        rows = 2 if cuda else max(2, len(self._micro_batches(batch)[0][0]))
        lengths = (batch["attention_mask"] != 0).sum(1)
        longest = int(np.argmax(lengths))
        variants = [[longest] * rows]
        if lengths.min() < lengths.max():
            variants.append([int(np.argmin(lengths))] + [longest] * (rows - 1))
        with torch.random.fork_rng(devices=[self.env.device] if cuda else []):
            for variant in variants:
                part = batch.take(variant)
                if method == "forward":
                    self.forward(part, *args, **kwargs)
                    continue
                self._check_usable("warm_up")
                (loss_fn,) = args
                mask = part["response_mask"].astype(np.float32)
                ctx = self._loss_context(mask, kwargs.get("temperature", 1.0))
                try:
                    self._gradients(part, loss_fn, ctx, kwargs.get("entropy", False))
                finally:
                    self.optimizer.zero_grad(set_to_none=True)
        if cuda:  # what the few rows cached goes back (a colocated vLLM measures the GPU)
            torch.cuda.empty_cache()

    def _inject_faults(self, sums: dict[str, torch.Tensor]) -> None:
        """Test-only (``polyrl.faults``): NaN loss and/or gradients in this update."""
        nan_loss = faults.active("nan_loss", self.step, self.cfg.role)
        if nan_loss:
            sums["loss"] = sums["loss"] + float("nan")
        if nan_loss or faults.active("nan_grad", self.step, self.cfg.role):
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            grad.fill_(float("nan"))

    def _apply_update(self, sums: dict[str, torch.Tensor], ctx: LossContext) -> dict[str, float]:
        """Clip and step, unless the loss or the gradient norm is not finite: then the
        update is skipped on every rank (both numbers are global, so all ranks agree),
        leaving weights and optimizer state untouched; the step counter still advances."""
        self._inject_faults(sums)
        totals = self._totals(sums)
        grad_norm, lr, finite = self._update(self.optim_cfg, np.isfinite(totals["loss"]))
        return {
            **totals,
            "grad_norm": grad_norm,
            "lr": lr,
            "global_tokens": ctx.global_tokens,
            "global_seqs": ctx.global_seqs,
            "nonfinite_skipped": float(not finite),
        }

    def _totals(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The micro-batches' loss and metric sums, summed over every rank."""
        if self.tp_mesh is not None and self.tp_mesh.get_local_rank() != 0:
            # The group computed one loss over its rows: count it once, from group rank 0.
            sums = {k: torch.zeros_like(v) for k, v in sums.items()}
        keys = sorted(sums)
        return dict(
            zip(keys, sharding.all_reduce_sum(torch.stack([sums[k] for k in keys])).tolist())
        )

    def _update(self, optim: OptimConfig, loss_finite: bool) -> tuple[float, float, bool]:
        """Clip the accumulated gradients and step AdamW with ``optim``'s hyper-parameters,
        unless the loss or the gradient norm is not finite (both global: every rank
        agrees); the gradients are cleared and the step counter advances either way.
        Returns (grad norm before clipping, learning rate, whether it stepped)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = sharding.clip_grad_norm(params, optim.grad_clip)
        lr = optim.lr_at(self.step)
        finite = bool(torch.isfinite(grad_norm)) and bool(loss_finite)
        if finite:
            for group in self.optimizer.param_groups:
                group.update(
                    lr=lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
                )
            self.optimizer.step()
        else:
            log.warning(
                "%s update %d: non-finite loss or grad norm %s, update skipped",
                self.cfg.role,
                self.step,
                grad_norm,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(grad_norm), lr, finite

    # --------------------------------------------------------------- weights
    @property
    def export_dtype(self) -> torch.dtype:
        return sharding.TORCH_DTYPES[self.cfg.dtype]

    def export_weights(self, bucket_bytes: int, trained_only: bool = False) -> Iterator[Bucket]:
        """Buckets of full tensors under HF names in ``ModelConfig.dtype`` on this rank's
        device; every rank must consume the iterator (each tensor is an all-gather)."""
        self._check_usable("export_weights")
        return weights.iter_buckets(
            self.model,
            bucket_bytes,
            self.export_dtype,
            self.env.device,
            self._lora_scale,
            keep=self.cfg.lora.changes if trained_only and self.cfg.lora else None,
        )

    @property
    def _lora_scale(self) -> float | None:
        """LoRA's ``alpha / rank``: exports merge the adapters (None: no LoRA)."""
        return None if self.cfg.lora is None else self.cfg.lora.scale

    def set_weights(self, named: dict[str, np.ndarray]) -> None:
        """Replace every weight with full arrays under HF names (another engine's)."""
        self._check_usable("set_weights")
        checkpoint.set_full_params(self.model, named)

    def save_hf(self, path: str) -> None:
        """HF directory (safetensors + config + tokenizer) of the current weights, loadable
        by transformers and vLLM; critic/reward as ``*ForSequenceClassification``."""
        self._check_usable("save_hf")
        head = self.model.score if self.cfg.has_value_head else None
        weights.save_hf(
            self.model,
            self.hf_config,
            self.cfg.path,
            path,
            dtype=self.export_dtype,
            device=self.env.device,
            is_main=self.env.is_main,
            value_head=head,
            lora_scale=self._lora_scale,
        )

    def save_adapters(self, path: str) -> None:
        """The LoRA adapters as a PEFT adapter directory (rank 0 writes; every rank gathers)."""
        self._check_usable("save_adapters")
        if self.cfg.lora is None:
            raise ValueError(
                "save_adapters: this engine has no LoRA adapters (ModelConfig.lora is None)"
            )
        adapters = {
            name.replace(f".{lora.ADAPTER}.", "."): weights.full(p.detach(), self.env.device)
            for name, p in self.model.named_parameters()
            if lora.is_adapter(name)
        }
        if self.env.is_main:
            arrays = {k: v.float().cpu().numpy() for k, v in adapters.items()}
            checkpoints.save_peft_adapters(path, arrays, self.cfg.lora, self.cfg.path)

    # ------------------------------------------------------------ checkpoint
    def _identity(self) -> dict:
        """What a checkpoint must match to load into this engine (role, model shape)."""
        lora_cfg = None if self.cfg.lora is None else self.cfg.lora.manifest()
        return {
            "role": self.cfg.role,
            "model": checkpoints.model_shape(self.cfg.path),
            **({"lora": lora_cfg} if lora_cfg else {}),
        }

    def save(self, path: str) -> None:
        """A DCP checkpoint; with LoRA only the adapters and their optimizer state (the
        frozen base is ``ModelConfig.path``'s)."""
        self._check_usable("save")
        extra = {"step": self.step, "world_size": self.env.world_size, **self._identity()}
        checkpoint.save_checkpoint(
            path, self.model, self.optimizer, extra, trainable_only=self.cfg.lora is not None
        )

    def load(self, path: str) -> None:
        """Restore :meth:`save`'s checkpoint, or an exchange directory another backend's
        checkpoint was converted into (``polyrl.backends.exchange``)."""
        self._check_usable("load")
        if exchange.is_exchange(path):
            extra = exchange.read_info(path)
            checkpoints.check_manifest(extra, self._identity(), path)
            checkpoint.load_exchange(path, self.model, self.optimizer)
            self.step = int(extra["step"])
            return
        extra = checkpoint.read_extra(path)
        checkpoints.check_manifest(extra, self._identity(), path)
        checkpoint.load_checkpoint(
            path, self.model, self.optimizer, trainable_only=self.cfg.lora is not None
        )
        self.step = int(extra["step"])

    # --------------------------------------------------------------- offload
    def _move_optimizer_state(self, device: torch.device) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device, non_blocking=True)

    def offload(self) -> None:
        """Free device memory: sharded parameters and optimizer state to host, gradients
        dropped. On a CPU world the state already lives in host memory, so only the
        gradients are dropped; with ``cpu_offload`` FSDP keeps it on the host already."""
        self._check_usable("offload")
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.env.device.type != "cpu" and not self.parallel.cpu_offload:
            self.model.to("cpu")
            if self.optimizer is not None:
                self._move_optimizer_state(torch.device("cpu"))
            torch.cuda.synchronize(self.env.device)
            torch.cuda.empty_cache()
        self._offloaded = True

    def reload(self) -> None:
        """Undo :meth:`offload` (a no-op when not offloaded)."""
        if not self._offloaded:
            return
        if self.env.device.type != "cpu" and not self.parallel.cpu_offload:
            self.model.to(self.env.device)
            if self.optimizer is not None:
                self._move_optimizer_state(self.env.device)
            torch.cuda.synchronize(self.env.device)
        self._offloaded = False
