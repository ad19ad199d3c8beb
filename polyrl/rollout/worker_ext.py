"""The vLLM worker extension that receives trainer weights in place.

vLLM mixes this class into every worker of an engine (``worker_extension_cls``); the
rollout server reaches its methods with ``LLM.collective_rpc("polyrl_...")``. One
weight update is always::

    polyrl_load_bucket(payload)      per bucket (or _ipc / _nccl variants)
    polyrl_finish_update()           once (vLLM-CPU only)

(the server resets the prefix cache when the update begins). Version-specific part
(kept to :func:`_open_layers`/:func:`_finish`):

* vLLM-CPU 0.32 packs every linear weight into an oneDNN handle and empties
  ``layer.weight``, so a plain ``model.load_weights`` writes into tensors the kernels
  never read. There we open vLLM's layer-wise reload (``initialize_layerwise_reload``:
  layers go back to checkpoint format and buffer what they receive until complete) for
  the layers each bucket loads into, stream the bucket through ``model.load_weights``,
  and close it (``finalize_layerwise_reload`` re-packs each reloaded layer). The
  worker's own ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``
  opens every layer at once and takes one iterator; opening per bucket lets buckets
  stream in with about one layer buffered (a layer split across two buckets is still
  processed whole), and leaves the layers an update does not send (a LoRA push's
  frozen base, the computed rotary cache, a tied ``lm_head``) packed as they are:
  opened, they would be put back unchanged with a "Failed to load weights" warning
  each. With tied embeddings ``lm_head`` loads nothing itself, so the reload never
  re-processes it; :func:`_finish` re-packs it from the shared weight. (An earlier vLLM-CPU build here showed a stale ``lm_head``
  after ``reload_weights``; on this host the streamed path is correct with and without
  the re-pack, fp32 and bf16 — which GEMM kernel vLLM picks, and whether it keeps a
  packed copy, depends on dtype, shape and CPU ISA — so it stays as a cheap guard.)
* GPU vLLM (0.26): ``model.load_weights`` copies into the live parameters; begin and
  finish have nothing to do (the server does not call them there). There each bucket
  goes through a load plan (``polyrl.rollout.load_plan``): the first bucket of each
  layout runs ``load_weights`` once while the planner records where every byte lands,
  later ones are a few fused copies out of the flat buffer (from the CUDA IPC buffer,
  which stays, one CUDA graph replay), with ``load_weights`` kept for any tensor the plan
  cannot cover. ``polyrl_set_load_plan(False)`` turns it off (benchmarks compare both).

Object-store buckets (see ``polyrl.weight_sync``) arrive as a list of ``(hf_name,
torch.Tensor)`` when the engine runs in the server's process, or as a file in host shared
memory that each worker maps (``polyrl_load_bucket_shm``) when the engine runs its workers
in other processes (vLLM's RPC turns tensors inside arguments into lists).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Methods vLLM adds to its Worker class (``self`` is the vLLM worker)."""

    # ----------------------------------------------------------- load protocol
    def polyrl_load_bucket(self, weights: list) -> int:
        """Load one bucket of ``(name, tensor)`` pairs; returns how many tensors."""
        _load(self, weights)
        return len(weights)

    def polyrl_load_bucket_shm(self, path: str, metas: list, nbytes: int) -> int:
        """Load the bucket a server wrote to a file in host shared memory
        (``weight_sync.shared_file``), from the mapping (no copy on the host), as the
        in-process engine loads host tensors: no device memory beyond the parameters."""
        from polyrl.weight_sync import map_shared

        weights = map_shared(path, metas, nbytes)
        _load(self, weights)
        return len(weights)

    def polyrl_finish_update(self) -> None:
        _finish(self)

    def polyrl_mask_logits(self, tokenizer_size: int) -> None:
        """Every logit past the tokenizer's ids (a model whose embedding is padded past
        its tokenizer, Qwen2.5) is -inf from here on, in every log-prob vLLM computes:
        sampled tokens' and the prompt's (``prompt_logprobs``, which skip the sampling
        processors and so the server's ``vocab_mask``) normalise over the tokenizer's
        ids, as the trainer's log-softmax does (``ModelConfig.sampling_vocab_size``).
        ``model.compute_logits`` runs outside vLLM's compiled graphs."""
        model = self.model_runner.model
        compute = model.compute_logits

        def masked(*args: Any, **kwargs: Any) -> Any:
            logits = compute(*args, **kwargs)
            if logits is not None:  # (tensor-parallel ranks other than the first: None)
                logits[..., tokenizer_size:] = float("-inf")
            return logits

        model.compute_logits = masked

    def polyrl_set_load_plan(self, enabled: bool) -> None:
        """Turn planned loads on or off (GPU only; vLLM-CPU always reloads layer-wise).
        Turning them back on starts from no plan."""
        if bool(enabled) != getattr(self, "polyrl_load_plan", True):
            self.polyrl_planner = None
        self.polyrl_load_plan = bool(enabled)

    def polyrl_load_plan_stats(self) -> dict[str, int]:
        """The planner's counters (learned, planned, graphed, fallback_tensors, refused)."""
        planner = getattr(self, "polyrl_planner", None)
        return dict(planner.stats) if planner is not None else {}

    def polyrl_param_checksum(self, name: str) -> float:
        """Sum of a parameter as float64 (tests check a load reached the kernels' copy)."""
        return float(dict(_model(self).named_parameters())[name].double().sum())

    # ------------------------------------------------------------- CUDA IPC
    def polyrl_load_bucket_ipc(self, slots: dict[str, Any] | bytes, metas: list) -> int:
        """Load a bucket shared by CUDA IPC: ``slots[device_uuid]`` is ``(key, handle,
        event handle)`` of the sender's persistent flat uint8 buffer on this worker's GPU
        (colocated: same device) and of the interprocess event the sender records once the
        bucket is in it. The copies out of the buffer wait for that event on this GPU's
        stream (the sender does not wait for its copies on the host). Buffer and event are
        opened once per key and kept: later buckets cost no IPC open
        (``polyrl.weight_sync.cuda_ipc._ipc_slot``)."""
        from polyrl.weight_sync import replaced_ipc_buffers, unpack_flat

        if isinstance(slots, bytes):  # pickled by a server whose engine core is a process
            slots = pickle.loads(slots)  # (its own trusted server: RolloutServer.load_bucket_ipc)
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        if uuid not in slots:
            raise RuntimeError(
                f"CUDA IPC weight sync: no buffer was shared for this worker's GPU {uuid} "
                f"(shared for {sorted(slots)}); IPC needs trainer and rollout colocated "
                f"on the same GPUs — use transport='nccl' for separate GPUs"
            )
        key, (rebuild, args), event = slots[uuid]
        opened = self.__dict__.setdefault("polyrl_ipc_buffers", {})
        if key not in opened:
            for old in replaced_ipc_buffers(opened, key):
                del opened[old]
                if getattr(self, "polyrl_planner", None) is not None:
                    self.polyrl_planner.release_graphs()  # they hold the old buffer
            args = list(args)
            args[6] = self.device.index  # the sender's device ordinal may differ from ours
            opened[key] = (rebuild(*args), torch.cuda.Event.from_ipc_handle(self.device, event))
        flat, ready = opened[key]
        torch.cuda.current_stream(self.device).wait_event(ready)
        weights = unpack_flat(flat, metas)
        _load(self, weights, flat, metas, persistent=True)
        torch.cuda.synchronize(self.device)  # the sender refills the buffer after the ack
        return len(weights)

    # ----------------------------------------------------- broadcast group
    def polyrl_join_group(
        self, key: str, host: str, port: int, rank_offset: int, world_size: int
    ) -> int:
        """Join weight-broadcast group ``key`` (rank 0 is the trainer; NCCL on GPU, gloo on
        CPU: ``polyrl.weight_sync.join_group``). Returns our rank."""
        from polyrl.weight_sync import join_group

        rank = rank_offset + self.rank
        join_group(key, host, port, rank, world_size, self.device)
        return rank

    def polyrl_load_bucket_nccl(
        self, key: str, metas: list, nbytes: int, timeout_s: float = 600.0, load: bool = True
    ) -> int:
        """Receive one flat bucket broadcast from rank 0 of group ``key`` (failing after
        ``timeout_s``: the trainer or another member died) and load it (unless ``load``
        is False: a resend after a re-formed group, of a bucket this worker has)."""
        from polyrl.weight_sync import group_broadcast, unpack_flat

        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        group_broadcast(key, flat, timeout_s)
        if not load:
            return 0
        weights = unpack_flat(flat, metas)
        _load(self, weights, flat, metas)
        return len(weights)


# ------------------------------------------------------------- version-specific
def _model(worker) -> torch.nn.Module:
    return worker.model_runner.model


def _load_weights(worker, weights) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        _model(worker).load_weights(weights=iter(weights))


def _load(worker, weights, flat=None, metas=None, persistent: bool = False) -> None:
    """Load one bucket: through the worker's load plan where the model keeps plain
    parameters (GPU), else (vLLM-CPU's layer-wise reload, plans turned off) with
    ``load_weights``. ``flat``/``metas``: the flat buffer the weights view, if any;
    ``persistent``: later buckets of the layout arrive in that buffer again (CUDA IPC)."""
    if _packs_cpu_weights():
        _load_weights(worker, _open_layers(worker, weights))
        return
    if not getattr(worker, "polyrl_load_plan", True):
        _load_weights(worker, weights)
        return
    if getattr(worker, "polyrl_planner", None) is None:
        from polyrl.rollout.load_plan import LoadPlanner

        worker.polyrl_planner = LoadPlanner(_model(worker), lambda w: _load_weights(worker, w))
    worker.polyrl_planner.load(weights, flat, metas, persistent)


def _packs_cpu_weights() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _open_layers(worker, weights: list) -> list:
    """Open vLLM-CPU's layer-wise reload for the layers the HF tensors ``weights`` load
    into (a layer already open stays as it is); returns the tensors to load. The model's
    own name mapping (``hf_to_vllm_mapper``, e.g. ``q_proj`` -> ``qkv_proj``) names the
    layer; a name it does not place on a layer's own parameter opens the whole model
    (what ``reload_weights`` does), so no tensor can reach a packed layer left closed.
    A tied ``lm_head`` is left out: the loader skips it, and with the embedding left
    closed it would take it for an alias of a tensor the bucket lacks and raise
    (:func:`_finish` re-packs it from the embedding)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = _model(worker)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    tied = worker.vllm_config.model_config.hf_config.tie_word_embeddings
    kept, layers = [], {}
    for name, tensor in weights:
        mapped = mapper.map_name(name) if mapper is not None else name
        if tied and (mapped or name).startswith("lm_head."):
            continue
        kept.append((name, tensor))
        if mapped is None or id(model) in layers:  # None: a tensor the loader skips
            continue
        path, _, param = mapped.rpartition(".")
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            layer = None
        if layer is None or param not in dict(layer.named_parameters(recurse=False)):
            layers = {id(model): model}
        else:
            layers[id(layer)] = layer
    with set_current_vllm_config(worker.vllm_config):
        for layer in layers.values():
            initialize_layerwise_reload(layer)
    return kept


def _finish(worker) -> None:
    if not _packs_cpu_weights():
        return
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = _model(worker)
    tied = worker.vllm_config.model_config.hf_config.tie_word_embeddings
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    if tied and hasattr(model, "lm_head"):
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
