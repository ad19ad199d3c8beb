"""A warm session: Ray, the rollout servers and the role workers of one model, kept
between runs (``polyrl session start|status|stop``; docs/sessions.md).

``polyrl session start --gin_file X`` checks the config, then starts a host process
(``polyrl.configure.session_host``, in a process session of its own) that
starts a private local Ray in the namespace :data:`NAMESPACE` and builds the run's loop
as ``polyrl train`` would (placement, rollout servers, role workers, warm-up), its rollout
servers and engine workers as named actors (``<role>:<rank>``) and its placement groups
named (``pool:<name>``). It writes ``session.json`` in the session directory
(``POLYRL_SESSION_DIR``, default ``~/.cache/polyrl/session``) and waits.

``polyrl train`` (without ``--no-session``) reads that file. A run that fits the session
(:func:`fingerprint`: backend, model, roles and their placement, pools, the whole
``RolloutConfig``, user imports, compile cache) connects to its Ray, looks the actors up
instead of starting them (WorkerGroup with :func:`borrowed`), rebuilds each role's engine
from the model's initial weights (fresh optimizer state) and pushes those weights to the
servers; at its end it lets go of them. A run that does not fit, finds the session busy
with another run, or finds it gone (host ended, Ray unreachable, an actor dead) says why in
one line and starts its own.

Stop: SIGTERM to the host, which ends its workers and its Ray; the watchdog of
``polyrl.cluster.ray_session`` ends whatever is left once the host is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "NAMESPACE",
    "SESSION_DIR_ENV",
    "Session",
    "session_dir",
    "fingerprint",
    "up",
    "connect",
    "attach",
    "release",
    "borrowed",
    "kept",
    "host_process",
    "current",
    "serving",
    "attached",
    "actor_name",
    "STATE",
    "HOST_MODULE",
]

NAMESPACE = "polyrl-session"
SESSION_DIR_ENV = "POLYRL_SESSION_DIR"
STATE = "session.json"
HOST_MODULE = "polyrl.configure.session_host"  # the host process: python -m HOST_MODULE HOST

# How this process treats the workers a session keeps: None (a plain run: its own),
# "serve" (the host: creates them named), "attach" (an attached run: looks them up).
_mode: str | None = None
_lock: Any = None  # an attached run's open attach.lock (held while the run lives)


def session_dir() -> Path:
    """Where the session's state lives: ``POLYRL_SESSION_DIR`` or ``~/.cache/polyrl/session``."""
    env = os.environ.get(SESSION_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "polyrl" / "session"


def kept(role: str) -> bool:
    """Whether a session keeps the workers of ``role`` (rollout servers, engine roles)."""
    from polyrl.role_table import ENGINE_ROLES, Role

    return role in (*ENGINE_ROLES, Role.ROLLOUT)


def borrowed(role: str) -> str | None:
    """How a WorkerGroup of ``role`` treats its workers here: None (its own), "serve"
    (create them as named actors) or "attach" (look up the session's)."""
    return _mode if _mode is not None and kept(role) else None


def current() -> str | None:
    """This process's session mode: None, "serve" or "attach" (see :func:`borrowed`)."""
    return _mode


def actor_name(role: str, rank: int) -> str:
    return f"{role}:{rank}"


@contextlib.contextmanager
def _as(mode: str) -> Iterator[None]:
    global _mode
    _mode = mode
    try:
        yield
    finally:
        _mode = None


def serving() -> contextlib.AbstractContextManager[None]:
    """The host builds its loop inside: its kept workers become named actors."""
    return _as("serve")


def attached() -> contextlib.AbstractContextManager[None]:
    """An attached run builds its loop inside: its kept workers are the session's."""
    return _as("attach")


def fingerprint(cfg: Any, spec: Any) -> dict[str, Any]:
    """What a run must share with the session it attaches to: what the kept workers were
    built with (the engines themselves are rebuilt from the run's own ModelConfig,
    OptimConfig and ParallelConfig, the servers are not), flat ``{field: value}``."""
    from polyrl.cluster.roles import build_roles

    out: dict[str, Any] = {
        "backend": cfg.backend,
        "model_path": str(cfg.model_path),
        "objective": spec.objective,
        "pools": dict(cfg.pools),
        "imports": list(cfg.imports),
        "cache_dir": cfg.cache_dir,
        # --debug: the debugger is set up in the workers a run starts (never a session)
        "debug": cfg.debug is not None and cfg.debug.enabled,
    }
    for name, role in build_roles(cfg, spec).items():
        where = {k: getattr(role, k) for k in ("pool", "num_workers", "hosts", "local_devices")}
        where["backend"] = role.backend
        where["model_path"] = role.model.path if role.model is not None else None
        out[f"roles.{name}"] = where
    if spec.objective == "rl":
        for k, v in dataclasses.asdict(cfg.rollout).items():
            out[f"rollout.{k}"] = v
    # A model the run builds in its own directory (the embedded tiny one, named by its
    # spec's hash) is the same model in every run dir.
    text = json.dumps(out, default=str).replace(
        json.dumps(str(Path(cfg.run_dir)))[1:-1], "<run_dir>"
    )
    return json.loads(text)  # as session.json holds it


def mismatch(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> str | None:
    """The first field where a run differs from the session, in words; None if it fits."""
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            return f"its {key} is {theirs.get(key)!r}, this run's {ours.get(key)!r}"
    return None


@dataclasses.dataclass
class Session:
    """A session as its ``session.json`` says: the host's pid, Ray's address, the Ray job
    whose workers it keeps, the named actors, the fingerprint and the gin it was started
    with."""

    dir: Path
    pid: int
    address: str
    job: str
    actors: list[str]
    fingerprint: dict[str, Any]
    gin_files: list[str]
    ready_s: float
    auth_mode: str

    @classmethod
    def read(cls, where: Path) -> Session | None:
        try:
            state = json.loads((where / STATE).read_text())
        except (OSError, ValueError):
            return None
        fields = {f.name for f in dataclasses.fields(cls)} - {"dir"}
        if not fields <= set(state):  # still starting, or failed
            return None
        return cls(dir=where, **{k: state[k] for k in fields})

    def host_alive(self) -> bool:
        return host_process(self.pid) is not None

    def ray_reachable(self) -> bool:
        host, port = self.address.rsplit(":", 1)
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 2.0):
            return True
        return False

    def gone(self) -> str | None:
        """Why the session cannot be used (its host ended, its Ray unreachable); None if up."""
        if not self.host_alive():
            return f"its host process {self.pid} has ended"
        if not self.ray_reachable():
            return f"its Ray ({self.address}) does not answer"
        return None

    def dead_actor(self, timeout_s: float = 10.0) -> str | None:
        """Connected to the session's Ray: the first kept actor that does not answer."""
        import ray

        for name in self.actors:
            try:
                ray.get(ray.get_actor(name).__ray_ready__.remote(), timeout=timeout_s)
            except (ValueError, ray.exceptions.RayError) as e:
                return f"its actor {name!r} is gone ({type(e).__name__})"
        return None


def host_process(pid: int) -> Any:
    """The session host ``pid`` (a ``psutil.Process``) while it runs; None once it ended."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE and HOST_MODULE in " ".join(p.cmdline()):
            return p
    except psutil.Error:
        pass
    return None


def _say(line: str) -> None:
    print(f"[session] {line}", flush=True)


def up() -> Session | None:
    """The session ``polyrl train`` may attach to: up, answering, and now this run's (it
    holds the attach lock); None where there is none, or it is gone or busy (said in one
    line: the run starts its own)."""
    global _lock
    where = session_dir()
    if not (where / STATE).exists():
        return None
    s = Session.read(where)
    why = "it holds no session that is up (still starting, or failed)" if s is None else s.gone()
    if why is not None:
        _say(
            f"the session in {where} is gone: {why}; starting this run's own Ray and workers "
            f"(clear it with polyrl session stop)"
        )
        return None
    lock = (where / "attach.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        _say(f"the session in {where} is busy with another run: starting this run's own")
        return None
    _lock = lock
    return s


def connect(s: Session, cfg: Any) -> Session | None:
    """Join the session's Ray (its namespace): ``polyrl train`` does it beside its checks.
    ``s``; None if its Ray refused (said in one line, the lock given back)."""
    import ray

    from polyrl.cluster.ray_session import init_ray

    if s.auth_mode:  # as the session's Ray does, or it refuses the connection
        from ray._raylet import Config

        os.environ["RAY_AUTH_MODE"] = s.auth_mode
        Config.initialize("")
    try:
        init_ray(
            cfg.run_dir, None, cfg.imports, cfg.debug, cfg.cache_dir, False, s.address, NAMESPACE
        )
    except Exception as e:
        ray.shutdown()
        release()
        said = str(e).strip().splitlines()
        _say(
            f"could not join the Ray of the session in {s.dir} ({s.address}: "
            f"{type(e).__name__}{': ' + said[0] if said else ''}); starting this run's own"
        )
        return None
    return s


def attach(s: Session, cfg: Any, spec: Any) -> Session | None:
    """After the checks, connected: ``s`` if the run fits it and its workers answer; else
    None, disconnected and the lock given back, with one line saying why."""
    import ray

    why = mismatch(s.fingerprint, fingerprint(cfg, spec))
    if why is not None:
        line = f"not attaching to the session in {s.dir}: {why}; starting this run's own"
    elif (why := s.dead_actor()) is not None:
        line = (
            f"the session in {s.dir} is broken: {why}; starting this run's own Ray and "
            f"workers (end it with polyrl session stop)"
        )
    else:
        _say(f"attached to the session in {s.dir} (host pid {s.pid}, Ray {s.address})")
        return s
    ray.shutdown()
    release()
    _say(line)
    return None


def release() -> None:
    """An attached run's end: let the session serve the next run."""
    global _lock
    if _lock is not None:
        _lock.close()
        _lock = None
