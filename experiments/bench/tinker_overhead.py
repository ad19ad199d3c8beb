"""What the Tinker API costs per call (docs/tinker.md, docs/performance.md "The Tinker
service"): one training step and one sample through the ``tinker`` client over HTTP
against ``polyrl serve-tinker``'s service, against the same work without it. Not a test;
numbers go to stdout and ``--json``.

Training step (``forward_backward`` + ``optim_step`` on the same datums, cross_entropy,
LoRA rank 8 on every projection of the served model), three ways:

* ``engine``: polyrl's in-process train step, ``TrainEngine.train_step`` of an engine
  built in this process (no Ray, no HTTP): the floor.
* ``ray``: the service's own path without HTTP: the training model's ``EngineGroup``
  ``forward_backward`` + ``optim_step`` (two Ray calls into its worker).
* ``client``: the ``tinker`` client: two requests, two futures polled over HTTP, protobuf
  bodies both ways.

Sample (``--prompts`` sample calls at once, ``num_samples`` completions of each prompt, every
completion ``--max-tokens`` long): ``pool`` = ``RolloutPool.generate_ids`` from this process,
``client`` = ``SamplingClient.sample``. Overhead = client - the rest; tokens/s of each (the
issue's GPU goals: the client's training tokens/s >= 0.9x the engine's, its sampled tokens/s
>= 0.95x the pool's).

    python experiments/bench/tinker_overhead.py                   # tiny model, torch, CPU
    python experiments/bench/tinker_overhead.py --backend jax_pjit --json t.json
    bash experiments/bench/gpu_run.sh tinker                      # 0.5B shape, one GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def timed(runs: dict, steps: int, warmup: int) -> dict[str, list[float]]:
    """Each run's times, the runs taking turns step by step (a machine whose load drifts
    slows them alike)."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch_fsdp", choices=("torch_fsdp", "jax_pjit"))
    p.add_argument("--batch", type=int, default=8, help="datums per forward_backward")
    p.add_argument("--length", type=int, default=48, help="tokens per datum")
    p.add_argument("--samples", type=int, default=8, help="num_samples per sample call")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per sample")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompts", type=int, default=1, help="sample calls in flight at once")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per sampled prompt")
    p.add_argument("--gin_param", action="append", default=[], help="a binding for the service")
    p.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    import numpy as np
    import ray
    import tinker
    from tinker import types

    from polyrl.algos.tinker_losses import tinker_loss
    from polyrl.backends.base import engine_on_one_device
    from polyrl.config import OptimConfig
    from polyrl.rollout import SamplingSpec
    from polyrl.service import DEFAULT_GIN, serve_in_thread, start
    from polyrl.service.wire import decode_forward_backward

    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    service = start([DEFAULT_GIN, f"gin/backends/{args.backend}.gin"], args.gin_param)
    server, url = serve_in_thread(service)
    client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    trainer = client.create_lora_training_client(base_model=service.name, rank=8).result()
    rng = np.random.default_rng(0)
    data = []
    for _ in range(args.batch):
        ids = rng.integers(3, 50, args.length + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * args.length},
            )
        )
    adam = types.AdamParams(learning_rate=1e-4)
    optim = OptimConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, grad_clip=None)
    loss = tinker_loss("cross_entropy")

    def client_step() -> None:
        fb = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(adam)
        fb.result()
        opt.result()

    # the same batch as the service builds it from the client's request body
    from tinker.proto.request_conv import forward_backward_request_to_proto

    body = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=trainer.model_id,
            seq_id=1,
        )
    ).SerializeToString()
    _, batch, _, _ = decode_forward_backward(body, 0)
    group = service.models[trainer.model_id].group

    def ray_step() -> None:
        group.forward_backward(batch, loss)
        group.optim_step(optim)

    # torch on one thread, as in the service's worker (Ray gives a half-CPU actor
    # OMP_NUM_THREADS=1)
    import torch

    torch.set_num_threads(1)
    actor, lora = service.actor, service.models[trainer.model_id].lora
    engine = engine_on_one_device(actor.backend)
    engine.init(dataclasses.replace(actor.model, lora=lora), optim, actor.parallel)

    def engine_step() -> None:
        engine.train_step(batch, loss)

    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompts = [rng.integers(3, 50, args.prompt_len).tolist() for _ in range(args.prompts)]
    # stop=[]: no stop token, every completion max_tokens long (the service's ignore_eos)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, stop=[])
    spec = SamplingSpec(
        temperature=1.0, max_tokens=args.max_tokens, seed=0, detokenize=False, ignore_eos=True
    )
    sampled: dict[str, int] = {}  # tokens per call, as each side returned them

    def client_sample() -> None:
        calls = [
            sampler.sample(types.ModelInput.from_ints(prompt), args.samples, params)
            for prompt in prompts
        ]
        sequences = [s for call in calls for s in call.result().sequences]
        sampled["client"] = sum(len(s.tokens) for s in sequences)

    def pool_sample() -> None:
        requests = [(j, prompt) for prompt in prompts for j in range(args.samples)]
        sampled["pool"] = sum(
            len(r["token_ids"]) for r in service.pool.generate_ids(requests, spec)
        )

    runs = {
        "train step: engine (in process)": engine_step,
        "train step: ray (EngineGroup)": ray_step,
        "train step: client (HTTP)": client_step,
        "sample: pool (in process)": pool_sample,
        "sample: client (HTTP)": client_sample,
    }
    results = {
        name: {"median_s": statistics.median(times), "min_s": min(times)}
        for name, times in timed(runs, args.steps, args.warmup).items()
    }
    server.should_exit = True
    service.shutdown()
    ray.shutdown()

    trained = args.batch * args.length
    for name, r in results.items():
        tokens = trained if name.startswith("train") else sampled[name.split()[1]]
        r["tokens_per_s"] = tokens / r["median_s"]
    print(
        f"{args.backend}, {service.name}, {args.batch} datums x {args.length} tokens, "
        f"sample {args.prompts} x {args.samples} x {args.max_tokens} tokens; median of {args.steps}:"
    )
    for name, r in results.items():
        print(
            f"  {name:<34} {r['median_s'] * 1e3:8.1f} ms  (min {r['min_s'] * 1e3:.1f})  "
            f"{r['tokens_per_s']:10.0f} tokens/s"
        )
    step = results["train step: client (HTTP)"]["median_s"]
    overhead = {
        "train_vs_engine_ms": (step - results["train step: engine (in process)"]["median_s"]) * 1e3,
        "train_vs_ray_ms": (step - results["train step: ray (EngineGroup)"]["median_s"]) * 1e3,
        "sample_vs_pool_ms": (
            results["sample: client (HTTP)"]["median_s"]
            - results["sample: pool (in process)"]["median_s"]
        )
        * 1e3,
    }
    print(
        "  overhead per step: {train_vs_engine_ms:.1f} ms over the engine, "
        "{train_vs_ray_ms:.1f} ms over the EngineGroup; per sample call: "
        "{sample_vs_pool_ms:.1f} ms over the pool".format(**overhead)
    )
    ratios = {
        "train_client_vs_engine": results["train step: client (HTTP)"]["tokens_per_s"]
        / results["train step: engine (in process)"]["tokens_per_s"],
        "sample_client_vs_pool": results["sample: client (HTTP)"]["tokens_per_s"]
        / results["sample: pool (in process)"]["tokens_per_s"],
    }
    print(
        "  tokens/s, client over the rest: training {train_client_vs_engine:.3f}x the engine's "
        "(goal >= 0.9x on a GPU), sampling {sample_client_vs_pool:.3f}x the pool's "
        "(goal >= 0.95x)".format(**ratios)
    )
    if args.json:
        with open(args.json, "w") as f:
            out = {"args": vars(args), "results": results, "overhead": overhead, "ratios": ratios}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
