"""LoRA on the torch backend, through PEFT (``ModelConfig.lora``; docs/backends.md "LoRA").

:func:`inject` puts PEFT's LoRA layers in place of the target projections of a loaded HF
model (``peft.inject_adapter_in_model``: no ``PeftModel`` wrapper, so the model keeps its
class, forward signature and HF names) and freezes every other parameter. A target
``<m>`` then holds ``<m>.base_layer.weight`` (the frozen ``W``), ``<m>.lora_A.default.weight``
``A`` [rank, in] (``LoraConfig.initial_a``: PEFT's Kaiming-uniform, seeded by name) and ``<m>.lora_B.default.weight`` ``B``
[out, rank] (zeros), and computes ``W x + scale * B A dropout(x)``, ``scale = alpha / rank``.
This happens before FSDP2 shards the model (``sharding.shard_model``) and before
``torch.compile`` wraps the decoder layers, so both see the adapted layers.

:func:`adapters_off` runs a forward as the frozen base model (the reference of a LoRA
run); :func:`merged` turns the gathered ``(name, tensor)`` stream into HF names with
``W + scale * B @ A`` in place of each target's weight (weight sync and HF export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from polyrl.config import LoraConfig

__all__ = ["inject", "adapters_off", "seeded_dropout", "merged", "is_adapter", "ADAPTER"]

ADAPTER = "default"  # PEFT's adapter name: parameter names carry it
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
_BASE = ".base_layer."


def inject(module: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Add LoRA adapters to ``cfg.target_modules`` of ``module`` (in place) and freeze
    everything but the adapters. The adapters are fp32 (the optimizer's master weights)
    whatever the base's dtype; FSDP's mixed precision computes them in the compute dtype."""
    import peft

    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )
    peft.inject_adapter_in_model(peft_cfg, module, adapter_name=ADAPTER)
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter(name))
        if is_adapter(name):
            param.data = param.data.float()
        if name.endswith(_A):  # the same A as the JAX backend's (LoraConfig.initial_a)
            a = cfg.initial_a(name.removesuffix(_A), tuple(param.shape))
            param.data.copy_(torch.from_numpy(a))
    return module


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter matrix (``A`` or ``B``)."""
    return name.endswith((_A, _B))


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """Inside, every LoRA layer of ``module`` computes its base layer alone.

    PEFT's public switch (``enable_adapters``) also flips the adapters' ``requires_grad``;
    FSDP2 copies that flag into the unsharded parameters it creates at the first
    all-gather, so a first forward with adapters off would leave them without gradients
    for good. The layers' own ``_disable_adapters`` flag (what ``enable_adapters`` sets
    besides) changes the forward and nothing else."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


@contextlib.contextmanager
def seeded_dropout(cfg: LoraConfig | None, step: int, rank: int, device: torch.device):
    """Inside, torch's RNG (CPU and ``device``'s) is seeded by the update's ``step`` and
    this ``rank``, and restored after: LoRA dropout's masks are a function of the step,
    so a rerun and a resumed run draw the same ones (the JAX backend folds the step into
    its key the same way). A no-op without dropout."""
    if cfg is None or cfg.dropout == 0:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed((step << 16) + rank)
        yield


def merged(
    pairs: Iterator[tuple[str, torch.Tensor]], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors from the adapted model's full tensors: each target's
    ``base_layer.weight`` W, ``lora_A`` A and ``lora_B`` B become one
    ``<m>.weight = W + scale * B @ A`` (fp32); ``base_layer.bias`` becomes ``<m>.bias``;
    everything else passes. PEFT registers W before A and B, so one target's three
    tensors are held at a time."""
    held: dict[str, torch.Tensor] = {}
    for name, full in pairs:
        if not name.endswith((_BASE + "weight", _A, _B)):
            yield name.replace(_BASE, "."), full
            continue
        held[name] = full
        prefix = name.removesuffix(_BASE + "weight").removesuffix(_A).removesuffix(_B)
        parts = (prefix + _BASE + "weight", prefix + _A, prefix + _B)
        if all(p in held for p in parts):
            w, a, b = (held.pop(p).float() for p in parts)
            yield prefix + ".weight", torch.addmm(w, b, a, alpha=scale)
    if held:
        raise RuntimeError(f"LoRA merge: incomplete targets left over: {sorted(held)}")
