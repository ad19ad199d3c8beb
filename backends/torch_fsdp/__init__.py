"""PyTorch FSDP2 training backend: ``engine.TorchFSDPEngine`` (registered as "torch_fsdp").

Modules mirror ``polyrl.backends.jax_pjit``: ``engine`` (the TrainEngine), ``models``
(HF loading, value head, per-token outputs), ``sharding`` (process group, DeviceMesh,
fully_shard), ``tensor_parallel`` (DTensor tensor parallelism of the decoder layers),
``weights`` (HF-named export, safetensors), ``checkpoint`` (DCP).
"""
