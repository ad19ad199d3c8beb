"""TrainEngine: the only thing the controller knows about a training backend.

Both backends (``torch_fsdp``, ``jax_pjit``) implement this Protocol with the same
semantics, so that one algorithm (a loss function from ``polyrl.algos``) gives the
same update on either. Shapes: ``B`` samples, ``P`` prompt tokens, ``R`` response
tokens; the sequence columns are described in ``polyrl.batch``.

Loss-function contract (docs/design.md "TrainEngine")
-----------------------------------------------------
``loss_fn(outputs, batch, ctx) -> (loss, metrics)`` where

* ``outputs``: the model's per-token outputs for one micro-batch, as the backend's own
  arrays: ``"log_probs"`` [B, R] (log-softmax of logits / temperature, gathered at the
  response tokens), ``"entropy"`` [B, R] when ``entropy=True``, ``"values"`` [B, R] for
  a value-head role;
* ``batch``: the micro-batch's numeric columns as the backend's arrays;
* ``ctx``: :class:`LossContext`, the global token/sequence counts of the whole
  optimizer step (all micro-batches and all data-parallel ranks).

``loss`` is this micro-batch's *contribution*: already divided by the global counts,
so the engine sums it over micro-batches and data-parallel ranks and never divides
again. Each metric follows the same rule (a summable contribution), so metrics do not
depend on micro-batching or world size either.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from polyrl.batch import Batch
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

__all__ = [
    "LossContext",
    "LossFn",
    "TrainEngine",
    "ENGINES",
    "Backend",
    "ProcessModel",
    "GroupSlot",
    "listen_for_group",
    "take_listener",
    "get_backend",
    "get_engine",
    "engine_on_one_device",
    "other_backend",
    "Bucket",
    "check_temperature",
    "tensor_split_problem",
    "ArrayBridge",
    "array_bridge",
]


@dataclasses.dataclass(frozen=True)
class LossContext:
    """Global normalisers of one optimizer step.

    global_tokens: number of valid response tokens (sum of ``response_mask``) in the
      whole mini-batch, over all micro-batches and data-parallel ranks.
    global_seqs: number of samples with at least one valid response token, likewise.
    temperature: the sampling temperature the log-probs were computed at.
    """

    global_tokens: float
    global_seqs: float
    temperature: float = 1.0


LossFn = Callable[
    [Mapping[str, Any], Mapping[str, Any], LossContext], tuple[Any, Mapping[str, Any]]
]

# One weight bucket: full (unsharded) tensors under Hugging Face parameter names, as
# the backend's arrays (torch.Tensor / jax.Array); weight_sync converts via DLPack.
Bucket = list[tuple[str, Any]]


@runtime_checkable
class TrainEngine(Protocol):
    """One role's model on one worker (torch: one rank; JAX: one host's devices)."""

    def init(self, model: ModelConfig, optim: OptimConfig | None, parallel: ParallelConfig) -> None:
        """Build or load the model, shard it, build the optimizer (None: frozen role).
        A trainable role (actor, critic) without ``optim``, or a frozen one with it, is a
        ``ValueError``."""

    def forward(
        self,
        batch: Batch,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        adapters: bool = True,
    ) -> dict[str, Any]:
        """No-grad per-token outputs as numpy: ``log_probs`` [B, R] (``entropy``,
        or for a value-head role ``values`` and ``scores`` [B], the head at each row's last
        real token). Zero where ``response_mask`` is 0. ``temperature`` <= 0 is a ValueError.
        ``adapters=False``: a LoRA actor scores with its adapters off, i.e. as the frozen
        base model (the reference); no effect without LoRA."""

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0, entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this worker's shard of one mini-batch).

        Splits into micro-batches of ``ParallelConfig.micro_batch_size``, accumulates
        gradients, clips by global norm, steps the optimizer and schedule. Returns
        ``loss``, ``grad_norm`` (before clipping), ``lr``, ``nonfinite_skipped`` and
        ``loss_fn``'s metrics. Rows with ``is_pad`` 1 contribute nothing; a batch with no
        valid response token (over all ranks) is a ValueError; a frozen role raises
        RuntimeError. A non-finite loss or gradient norm skips the update on every rank:
        weights and optimizer state stay bit-identical, ``nonfinite_skipped`` is 1.
        """

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0
    ) -> dict[str, Any]:
        """Forward and backward on ``batch`` (this worker's shard) without an optimizer
        step: the gradients add to those of earlier calls until :meth:`optim_step` (the
        Tinker API's split of a step, ``polyrl.service``). Returns ``log_probs`` [B, R]
        (numpy, the policy before the update; zero where ``response_mask`` is 0) and the
        sums of the loss and ``loss_fn``'s metrics over every rank. Optional: an engine
        without it cannot serve the Tinker API."""

    def optim_step(self, optim: OptimConfig) -> dict[str, float]:
        """One optimizer update from the gradients :meth:`forward_backward` accumulated,
        with ``optim``'s hyper-parameters (``lr_at(step)``, betas, eps, weight decay,
        ``grad_clip``) instead of the engine's own; clears the gradients. Returns
        ``grad_norm`` (before clipping) and ``lr``. Optional, as :meth:`forward_backward`."""

    def reset_optimizer(self) -> None:
        """A fresh optimizer on the current weights: no moments, no pending gradients
        (a Tinker ``load_state`` without the optimizer). Optional, as :meth:`forward_backward`."""

    def warm_up(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> None:
        """Prepare what ``getattr(self, method)(batch, *args, **kwargs)`` will run
        (``method``: "forward" or "train_step"), so that call finds its programs compiled:
        the trainer calls it while the rollout servers start (``RunConfig.warm_up``).
        Changes no weight, optimizer state, step or RNG, and keeps little device memory
        (a colocated vLLM sizes its KV cache meanwhile). torch: the ``torch.compile``
        graphs, traced on a few rows (they are shape-generic; eager engines have nothing
        to prepare); JAX: every jitted program for ``batch``'s padded shapes, lowered and
        compiled ahead without running."""

    def export_weights(self, bucket_bytes: int, trained_only: bool = False) -> Iterator[Bucket]:
        """Full tensors under HF names (with LoRA: the merged ``W + scale * B @ A`` under
        the base names) in buckets of about ``bucket_bytes``; never more
        than one bucket of gathered weights alive at a time. ``trained_only``: only the
        tensors training can change (with LoRA the adapted modules' merged weights, the
        rest is the frozen base; without LoRA every tensor)."""

    def save_adapters(self, path: str) -> None:
        """A LoRA actor's adapters as a PEFT adapter directory at ``path``
        (``polyrl.checkpoints.save_peft_adapters``); every rank must call it. Without
        LoRA: ValueError."""

    def set_weights(self, named: Mapping[str, Any]) -> None:
        """Replace every weight with full arrays (numpy) under HF names, as another
        engine's ``export_weights`` gave them (the shadow check, ``polyrl.observe.shadow``)."""

    def save(self, path: str) -> None:
        """Checkpoint model, optimizer, schedule, RNG and step to directory ``path``."""

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote; the next step equals the uninterrupted run's."""

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory."""

    def reload(self) -> None:
        """Undo :meth:`offload`."""


def check_temperature(temperature: float) -> None:
    """Every engine's forward/train_step refuses a temperature that is not > 0."""
    if not temperature > 0:
        raise ValueError(
            f"temperature={temperature} must be > 0 (log-probs use logits / temperature); "
            "for greedy rollouts score at temperature=1.0"
        )


# Model sizes (config.json) a ``tensor`` mesh axis splits: both backends shard attention
# heads, key/value heads and the MLP width over it (config.DEFAULT_LOGICAL_RULES).
TENSOR_SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def tensor_split_problem(shape: Mapping[str, Any], tensor: int, where: str) -> str | None:
    """Why a model of ``shape`` (``checkpoints.model_shape``) cannot split over a
    ``tensor`` axis of this size (None: it can); ``where`` names the mesh binding. Both
    validate-config (``polyrl.cluster.roles``) and an engine that starts on a bad mesh ask it."""
    sizes = {k: shape.get(k) for k in TENSOR_SPLIT_KEYS}
    if not sizes["num_key_value_heads"]:  # multi-head attention: as many as query heads
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    sizes = {k: int(v) for k, v in sizes.items() if v}
    bad = {k: v for k, v in sizes.items() if v % tensor}
    if tensor == 1 or not bad:
        return None
    common = math.gcd(*sizes.values())
    fits = [t for t in range(1, min(common, 8) + 1) if common % t == 0]
    return (
        f"{where} tensor={tensor}: the model's "
        + ", ".join(f"{k}={v}" for k, v in bad.items())
        + f" does not split over {tensor} tensor-parallel ranks; set tensor to one of {fits} "
        "and give the other devices to fsdp/data"
    )


def _torch_compile_problem(compile: bool, tensor: int, where: str) -> str | None:
    """torch: inductor fails on the tensor-parallel (DTensor) decoder layers (RecursionError
    while compiling, torch 2.13)."""
    if not compile or tensor == 1:
        return None
    return (
        f"{where} tensor={tensor} with ModelConfig.compile=True (RunConfig.compile): "
        "torch.compile of tensor-parallel decoder layers fails in the torch_fsdp backend; "
        "set compile=False, or tensor=1 and give the devices to fsdp/data"
    )


def _no_compile_problem(compile: bool, tensor: int, where: str) -> str | None:
    """JAX compiles everything anyway and ignores ``ModelConfig.compile``."""
    return None


def _torch_checkpoint_problem(model: ModelConfig, where: str) -> str | None:
    """torch: checkpoint_policy "budget" is the compiler's partitioner, which acts on the
    compiled layers of a trained role only."""
    budget = model.gradient_checkpointing and model.checkpoint_policy == "budget"
    if not budget or model.compile or not model.trainable:
        return None
    return (
        f"{where}: checkpoint_policy='budget' on torch_fsdp needs compile=True "
        "(RunConfig.compile): torch.compile's partitioner chooses what each layer "
        "recomputes; set compile = True, or checkpoint_policy = 'full'"
    )


def _no_checkpoint_problem(model: ModelConfig, where: str) -> str | None:
    """JAX applies every checkpoint policy itself (``recompute.py``)."""
    return None


def _torch_lora_problem(lora: Any, tensor: int, where: str) -> str | None:
    """torch: the tensor-parallel plan splits ``nn.Linear`` projections, which PEFT has
    replaced by its LoRA layers."""
    if lora is None or tensor == 1:
        return None
    return (
        f"{where} tensor={tensor} with RunConfig.lora: the torch_fsdp backend's tensor "
        "parallelism does not split PEFT's LoRA layers; set tensor=1 and give the devices "
        "to fsdp/data, or use the jax_pjit backend"
    )


def _no_lora_problem(lora: Any, tensor: int, where: str) -> str | None:
    """JAX shards the LoRA adapters by the same rules as their projections."""
    return None


@dataclasses.dataclass(frozen=True)
class GroupSlot:
    """One worker's place in its role's collective group.

    rank / world: this worker among the role's workers; node / local_rank /
    local_world: its node (in pool order), its index there and its node's worker count;
    addr / port: where worker 0 listens for the group's rendezvous.
    """

    rank: int
    world: int
    node: int
    local_rank: int
    local_world: int
    addr: str
    port: int


# The sockets listen_for_group keeps listening in this process, by port.
_LISTENING: dict[int, socket.socket] = {}


def listen_for_group() -> int:
    """A free port on every address of this host, listened on from now: the socket stays
    in this process until :func:`take_listener` hands it over, so no other process can
    take the port meanwhile (a group's worker 0, between the rendezvous and its store)."""
    if socket.has_dualstack_ipv6():  # as torch's store listens: IPv6 and IPv4 addresses
        s = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        s = socket.create_server(("", 0))
    port = s.getsockname()[1]
    _LISTENING[port] = s
    return port


def take_listener(port: int) -> int | None:
    """The file descriptor of the socket :func:`listen_for_group` keeps listening on
    ``port`` in this process, now the caller's to close; None if this process keeps none
    (a process torchrun started, a worker that is not its group's rank 0)."""
    s = _LISTENING.pop(port, None)
    return None if s is None else s.detach()


def _torch_group_env(slot: GroupSlot) -> dict[str, str]:
    # torchrun's variables: backends/torch_fsdp/sharding.py init_distributed reads them.
    return {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.world),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_world),
        "MASTER_ADDR": slot.addr,
        "MASTER_PORT": str(slot.port),
    }


# backends/jax_pjit/distributed.py joins jax.distributed from these (one process per host).
JAX_COORDINATOR_ENV = "POLYRL_JAX_COORDINATOR"
JAX_NUM_PROCESSES_ENV = "POLYRL_JAX_NUM_PROCESSES"
JAX_PROCESS_ID_ENV = "POLYRL_JAX_PROCESS_ID"


def _jax_group_env(slot: GroupSlot) -> dict[str, str]:
    if slot.world == 1:
        return {}
    return {
        JAX_COORDINATOR_ENV: f"{slot.addr}:{slot.port}",
        JAX_NUM_PROCESSES_ENV: str(slot.world),
        JAX_PROCESS_ID_ENV: str(slot.rank),
    }


def _jax_one_device() -> dict[str, Any]:
    import jax

    return {"devices": jax.local_devices()[:1]}


def _jax_host_env(local_devices: int, on_gpu: bool) -> dict[str, str]:
    if on_gpu:
        # Pin the platform: a driver that set JAX_PLATFORMS=cpu (a CPU test session, a
        # laptop's shell) would otherwise hand its GPU workers host devices (seen on 2 x H200).
        return {"JAX_PLATFORMS": "cuda"}
    # On CPU a host worker gets its share of the mesh as host-platform devices.
    return {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}",
    }


@dataclasses.dataclass(frozen=True)
class ProcessModel:
    """How one role of a backend spans devices and hosts (docs/design.md "Placement").

    worker_per: ``"device"``: one Ray worker per device, each a rank of a collective
      group (torch.distributed); ``"host"``: one worker per host driving every local
      device of the role's mesh, hosts joined into one multi-controller program
      (jax.distributed).
    collective: the library that forms the group (for messages and docs).
    host_env: ``(local_devices, on_gpu) -> env`` a worker needs before its framework
      is imported (e.g. JAX's host device count on CPU).
    group_env: ``GroupSlot -> env`` with which a worker joins its role's group.
    one_device: ``() -> kwargs`` of the engine's constructor for a world of one device
      in this process (``polyrl export``, ``polyrl diagnose``): a per-device process is
      one rank already; a per-host one is given its first local device.
    listen: ``() -> port``, run by the rendezvous in worker 0's process: the port where
      a group of several workers meets, kept listening there until the collective's
      store takes the socket over (torch's TCPStore takes one: :func:`listen_for_group`);
      None: a free port that the rendezvous closes again and the collective binds itself
      (jax.distributed's coordinator takes no socket: another process may take the port
      in between).
    """

    worker_per: str
    collective: str
    host_env: Callable[[int, bool], dict[str, str]]
    group_env: Callable[[GroupSlot], dict[str, str]]
    one_device: Callable[[], dict[str, Any]] = dict
    listen: Callable[[], int] | None = None

    def num_workers(self, devices: int, hosts: int) -> int:
        """Workers of a role whose mesh has ``devices`` devices over ``hosts`` hosts."""
        return devices if self.worker_per == "device" else hosts

    def devices_per_worker(self, devices: int, hosts: int) -> int:
        return 1 if self.worker_per == "device" else devices // hosts


@dataclasses.dataclass(frozen=True)
class ArrayBridge:
    """How weight sync (``polyrl.weight_sync.packing``) handles a backend's arrays when
    they are not torch tensors. ``types``: the top-level packages of the array types
    (``type(x).__module__``); ``module``: imported on first use, it provides
    ``on_one_device(x)`` (the whole array on one device, for DLPack), ``torch_device(x)``
    and ``pack(bucket, alloc) -> (flat uint8 tensor, metas) | None`` (None: not packable
    on device; the generic path packs it)."""

    types: tuple[str, ...]
    module: str


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registry entry: the engine class (``"module:Class"``, imported lazily, so the
    core never imports torch or jax), the backend's process model, the framework whose
    profiler records its workers (``polyrl.observe.profiler``; ``RunConfig.profile_steps``), the
    function (``"module:function"``, path -> ``polyrl.backends.exchange.Exchange``) that reads one of
    its engine checkpoints for the other backend (``polyrl.backends.exchange``), why
    ``ModelConfig.compile`` cannot run on a ``tensor`` axis (``compile_problem(compile,
    tensor, where) -> str | None``, asked by validate-config and the engine), the same
    for LoRA (``lora_problem(lora, tensor, where)``), why a model's activation
    checkpointing cannot run (``checkpoint_problem(model, where)``) and the bridge weight
    sync reaches its arrays through (None: its arrays are torch tensors)."""

    engine: str
    process: ProcessModel
    profiler: str
    exporter: str
    compile_problem: Callable[[bool, int, str], str | None] = _no_compile_problem
    lora_problem: Callable[[Any, int, str], str | None] = _no_lora_problem
    checkpoint_problem: Callable[[ModelConfig, str], str | None] = _no_checkpoint_problem
    arrays: ArrayBridge | None = None


# Registered backends. The controller core reads a backend's process model from here
# and never asks for a backend by name.
ENGINES: dict[str, Backend] = {
    "torch_fsdp": Backend(
        "polyrl.backends.torch_fsdp.engine:TorchFSDPEngine",
        ProcessModel(
            "device",
            "torch.distributed",
            lambda devices, gpu: {},
            _torch_group_env,
            listen=listen_for_group,
        ),
        "torch",
        "polyrl.backends.torch_fsdp.checkpoint:export_exchange",
        compile_problem=_torch_compile_problem,
        lora_problem=_torch_lora_problem,
        checkpoint_problem=_torch_checkpoint_problem,
    ),
    "jax_pjit": Backend(
        "polyrl.backends.jax_pjit.engine:JaxPjitEngine",
        # No listen: jax.distributed's coordinator binds its port itself (it takes no
        # listening socket), so a multi-host JAX role keeps the window between the
        # rendezvous and that bind in which another process can take the port.
        ProcessModel("host", "jax.distributed", _jax_host_env, _jax_group_env, _jax_one_device),
        "jax",
        "polyrl.backends.jax_pjit.checkpoint:export_exchange",
        arrays=ArrayBridge(("jax", "jaxlib"), "polyrl.backends.jax_pjit.bridge"),
    ),
}


def get_backend(name: str) -> Backend:
    if name not in ENGINES:
        raise ValueError(f"unknown backend {name!r}; registered backends: {sorted(ENGINES)}")
    return ENGINES[name]


def other_backend(name: str) -> str:
    """The registered backend that is not ``name`` (the shadow check's, polyrl.observe.shadow)."""
    return next(other for other in ENGINES if other != name)


def get_engine(name: str) -> type:
    """The engine class registered as ``name`` (imports its framework)."""
    module, _, cls = get_backend(name).engine.partition(":")
    return getattr(importlib.import_module(module), cls)


def engine_on_one_device(name: str) -> Any:
    """A new engine of backend ``name`` in this process, driving one local device
    (:attr:`ProcessModel.one_device`)."""
    return get_engine(name)(**get_backend(name).process.one_device())


def array_bridge(x: Any) -> Any:
    """The bridge module (``ArrayBridge.module``) of the backend whose array ``x`` is, by
    its type's top-level package; None for torch tensors, numpy arrays and the rest."""
    top = type(x).__module__.partition(".")[0]
    for backend in ENGINES.values():
        if backend.arrays is not None and top in backend.arrays.types:
            return importlib.import_module(backend.arrays.module)
    return None
