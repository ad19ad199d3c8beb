"""A Tinker-compatible training service (docs/tinker.md): the HTTP API the ``tinker``
Python client speaks, served by the run's own parts. Each training client is an actor
``EngineGroup`` (LoRA adapters on the served model, on the backend the gin file names)
whose ``forward_backward`` / ``optim_step`` run the losses of ``polyrl.algos``
(``tinker_losses``); each sampling client samples from the run's rollout servers after
its weights are pushed into them, as a training run pushes them.

``polyrl serve-tinker`` = :func:`serve`; tests and benchmarks use :func:`start` and
:func:`serve_in_thread`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_GIN", "serve", "serve_in_thread", "start"]

DEFAULT_GIN = "gin/experiments/tinker_service.gin"


def start(gin_files: Sequence[str] = (DEFAULT_GIN,), gin_params: Sequence[str] = ()) -> Any:
    """Parse and check the gin files, start Ray (unless it runs), reserve the run's pools
    (``polyrl.cluster.placement.Placement``, as a training run does), start the rollout
    servers on the rollout's share and the service's state
    (:class:`polyrl.service.state.TinkerService`); training models start, on the actor's
    share, when clients ask for them. ``RunConfig.run_dir`` holds what clients save."""
    import ray
    from transformers import AutoTokenizer

    from polyrl.backends.base import get_engine
    from polyrl.cluster.placement import Placement
    from polyrl.cluster.roles import build_roles
    from polyrl.config import TinkerConfig
    from polyrl.configure.launch import init_run_ray, parse_config, prepare, servers
    from polyrl.errors import ConfigError
    from polyrl.role_table import SERVICE_ROLES, Role
    from polyrl.service.state import TinkerService

    cfg, _ = parse_config(gin_files, gin_params)
    cfg, spec = prepare(cfg)
    roles = {r: s for r, s in build_roles(cfg, spec).items() if r in SERVICE_ROLES}
    actor = roles[Role.ACTOR]
    if not hasattr(get_engine(actor.backend), "forward_backward"):
        raise ConfigError(
            f"polyrl.RunConfig.backend={actor.backend!r}: its engine has no forward_backward / "
            "optim_step, which the Tinker API needs; pick a backend that has them"
        )
    if not ray.is_initialized():
        init_run_ray(cfg)
    placement = Placement(cfg.pools, roles)
    try:
        pool = servers(placement, Role.ROLLOUT, cfg.rollout)
    except BaseException:
        placement.release()
        raise
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    vocab = pool.planned_sampling_vocab(len(tokenizer))
    actor = dataclasses.replace(
        actor, model=dataclasses.replace(actor.model, sampling_vocab_size=vocab)
    )
    name = Path(cfg.model_path).name
    return TinkerService(
        actor,
        pool,
        Path(cfg.run_dir),
        name,
        cfg.rollout.max_model_len,
        placement,
        cfg.tinker or TinkerConfig(),
    )


def _server(service: Any, host: str, port: int) -> Any:
    import uvicorn

    from polyrl.service.app import make_app

    config = uvicorn.Config(make_app(service), host=host, port=port, log_level="warning")
    return uvicorn.Server(config)


def serve(
    gin_files: Sequence[str] = (DEFAULT_GIN,),
    gin_params: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
) -> None:
    """``polyrl serve-tinker``: start, print where to connect, serve until interrupted."""
    service = start(gin_files, gin_params)
    server = _server(service, host, port)
    print(
        f"[polyrl] Tinker API on http://{host}:{port} serving {service.name!r} "
        f"from {service.model_path}: "
        f"TINKER_BASE_URL=http://{host}:{port} TINKER_API_KEY=tml-local",
        flush=True,
    )
    try:
        server.run()
    finally:
        service.shutdown()


def serve_in_thread(service: Any, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, str]:
    """Serve ``service`` from a thread of this process (tests, benchmarks); returns the
    uvicorn server (``server.should_exit = True`` stops it) and the base URL. The socket is
    bound here (``port`` 0: a free one) and handed to uvicorn, so no other process can take
    the port in between; a server that fails to start raises instead of being waited for."""
    import socket
    import time

    sock = socket.socket()
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = _server(service, host, port)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RuntimeError(f"the Tinker service did not start on {host}:{port}")
        time.sleep(0.05)
    return server, f"http://{host}:{port}"
