"""Debugging inside remote roles with Ray's distributed debugger (debugpy).

``polyrl train --debug`` (or any ``polyrl.DebugConfig`` binding) turns on, in every role
worker, rollout server and reward worker:

- ``DebugConfig.breakpoints``: places to pause, ``"<role>.<method>"`` with an optional
  ``" if <condition>"`` evaluated in the remote process, e.g.
  ``"actor.train_step if step == 3"`` or ``"reward.score if min(scores) < -1"``;
- ``DebugConfig.log_points``: ``{"<role>.<method>": "<expression>"}``, logged (the
  worker's output reaches the driver) instead of pausing;
- ``DebugConfig.post_mortem``: pause where a role method raises;
- a plain ``breakpoint()`` in user code (a reward function, a loss), in a worker or in
  the driver.

A condition or expression sees the method's arguments by name, ``step`` (the batch's
training step, None when unknown), ``rank``, ``role`` and, once the method has returned,
its result as ``result`` (and as ``scores`` for ``reward.score``, ``metrics`` for
``train_step``, ``outputs`` for ``forward`` and ``generate``). A condition that needs the
result is evaluated after the call, the others before it.

A paused process listens for a debugger (Debug Adapter Protocol, debugpy) on
``DebugConfig.host`` (127.0.0.1 unless you open it) and the driver prints::

    [debug] actor rank 0 paused at /path/polyrl/cluster/workers.py:71; attach to 127.0.0.1:40123

then waits, repeating ``nobody attached`` every ``report_every_s`` seconds. The paused
frame's locals are the method's arguments (and ``step``, ``rank``, ``result``), at the
method's own file and line. Roles: the names of ``polyrl.role_table.Role`` (``actor``,
``critic``, ``reference``, ``reward_model``, ``shadow``: engine workers; ``reward``: the
rule-reward workers; ``rollout``; ``env``). Methods: ``forward``, ``train_step``,
``sync_weights``, ``call`` (engine roles), ``score`` (reward workers), ``generate``
(rollout).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from polyrl.observe.timeline import record
from polyrl.role_table import Role

__all__ = [
    "DebugConfig",
    "DebugSession",
    "debugging",
    "for_debugging",
    "place",
    "setup_worker",
    "DEBUG_ENV",
]

DEBUG_ENV = "POLYRL_DEBUG"  # the DebugConfig as JSON, in every worker's environment
KV_PREFIX = "polyrl:debug:"
# and "task": any other worker; a judge's own servers are rollout servers ("rollout.generate")
ROLES = tuple(str(role) for role in Role if role is not Role.JUDGE)
METHODS = ("forward", "train_step", "sync_weights", "call", "score", "generate")
RESULT_ALIAS = {
    "score": "scores",
    "train_step": "metrics",
    "forward": "outputs",
    "generate": "outputs",
}

log = logging.getLogger("polyrl.observe.debug")


def _parse_place(place: str, owner: str) -> tuple[str, str]:
    role, _, method = place.partition(".")
    if role not in ROLES or method not in METHODS:
        raise ValueError(
            f"{owner}: {place!r} is not a place to stop; give '<role>.<method>' with role one "
            f"of {list(ROLES)} and method one of {list(METHODS)}, e.g. 'actor.train_step'"
        )
    return role, method


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    """Ray's distributed debugger for the run's remote roles (see the module docstring).

    enabled: set by ``polyrl train --debug``; also on when any of breakpoints,
      log_points or post_mortem is set.
    breakpoints: ``"<role>.<method>"`` or ``"<role>.<method> if <condition>"``.
    log_points: ``{"<role>.<method>": "<expression>"}``.
    post_mortem: pause in the frame that raised when a role method fails.
    host: address the debuggers (and the Ray dashboard) listen on; "0.0.0.0" opens them
      to the network, which lets anyone who can reach the port run code in the run.
    report_every_s: how often the driver repeats that a pause has nobody attached.
    """

    enabled: bool = False
    breakpoints: tuple[str, ...] = ()
    log_points: Mapping[str, str] = dataclasses.field(default_factory=dict)
    post_mortem: bool = False
    host: str = "127.0.0.1"
    report_every_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "breakpoints", tuple(self.breakpoints))
        object.__setattr__(self, "log_points", dict(self.log_points))
        for bp in self.breakpoints:
            place, _, cond = bp.partition(" if ")
            _parse_place(place.strip(), "DebugConfig.breakpoints")
            if cond:
                _compile(cond, f"DebugConfig.breakpoints {bp!r}")
        for place, expr in self.log_points.items():
            _parse_place(place, "DebugConfig.log_points")
            _compile(expr, f"DebugConfig.log_points[{place!r}]")
        if self.breakpoints or self.log_points or self.post_mortem:
            object.__setattr__(self, "enabled", True)

    def points(self, role: str, method: str) -> list[tuple[str, str | None]]:
        """("break", condition) and ("log", expression) entries of one role method."""
        out: list[tuple[str, str | None]] = []
        for bp in self.breakpoints:
            place, _, cond = bp.partition(" if ")
            if _parse_place(place.strip(), "") == (role, method):
                out.append(("break", cond.strip() or None))
        for place, expr in self.log_points.items():
            if _parse_place(place, "") == (role, method):
                out.append(("log", expr))
        return out

    def env(self) -> dict[str, str]:
        """Environment variables that turn the debugger on in a worker (the terminal
        debugger when the driver runs with ``RAY_DEBUG=legacy``)."""
        mode = "legacy" if legacy() else "1"
        return {DEBUG_ENV: json.dumps(dataclasses.asdict(self)), "RAY_DEBUG": mode}


def _compile(expr: str, owner: str) -> Any:
    try:
        return compile(expr, f"<{owner}>", "eval")
    except SyntaxError as e:
        raise ValueError(f"{owner}: {expr!r} is not a Python expression ({e.msg})") from None


# ---------------------------------------------------------------- in the worker process
_state: dict[str, Any] = {"config": None, "role": None, "rank": 0, "port": None}
_lock = threading.Lock()


def setup_worker(role: str, rank: int) -> None:
    """Called first in a role worker's constructor: when ``POLYRL_DEBUG`` is set, remember
    the role and rank and route ``breakpoint()`` to :func:`user_breakpoint`."""
    raw = os.environ.get(DEBUG_ENV)
    if not raw:
        return
    _state.update(config=DebugConfig(**json.loads(raw)), role=role, rank=rank)
    sys.breakpointhook = user_breakpoint


def debugging() -> bool:
    """Whether this process runs under ``--debug`` (``setup_worker`` found the config):
    code that times out its own calls (an env worker's tools) waits instead, so a call
    paused at a breakpoint is not cut while you step through it."""
    return _state["config"] is not None


def _listen() -> tuple[str, int]:
    """debugpy listening on DebugConfig.host (once per process); the port is registered
    with Ray so the dashboard and the VS Code extension list the worker."""
    import debugpy

    with _lock:
        host = _state["config"].host
        if _state["port"] is None:
            _, port = debugpy.listen((host, 0))
            _state["port"] = port
            # debugpy's pydevd installs its own breakpointhook when imported (it is now):
            # keep ours, or every breakpoint() after this first pause would be silent
            sys.breakpointhook = user_breakpoint
            worker = _ray_worker()
            if worker is not None:
                worker.set_debugger_port(port)
        return host, _state["port"]


def _ray_worker() -> Any:
    try:
        import ray

        if ray.is_initialized():
            return ray._private.worker.global_worker
    except Exception:  # outside Ray (a test, the driver without Ray)
        return None
    return None


def _announce(where: str, host: str, port: int, **extra: Any) -> None:
    """Record this pause where the driver looks for it (Ray's internal KV store)."""
    record = {"role": _state["role"], "rank": _state["rank"], "where": where}
    record |= {"host": host, "port": port, "pid": os.getpid(), "since": time.time(), **extra}
    try:  # the driver's DebugSession prints it
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(f"{KV_PREFIX}{os.getpid()}", json.dumps(record))
    except Exception:  # no Ray here: print it ourselves
        print(_line(record), flush=True)


def _attached() -> None:
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(f"{KV_PREFIX}{os.getpid()}")
    except Exception:
        pass


def _line(r: Mapping[str, Any]) -> str:
    return (
        f"[debug] {r['role']} rank {r['rank']} paused at {r['where']}; "
        f"attach to {r['host']}:{r['port']}"
    )


def _wait_for_client() -> None:
    import debugpy

    if debugpy.is_client_connected():  # a later pause, the debugger still attached: the
        # record stays a few of the driver's 1 s polls so that it prints this pause too
        threading.Timer(2.5, _attached).start()
        return
    worker = _ray_worker()
    if worker is not None:
        with worker.worker_paused_by_debugger():
            debugpy.wait_for_client()
    else:
        debugpy.wait_for_client()
    _attached()


def legacy() -> bool:
    """``RAY_DEBUG=legacy``: Ray's terminal debugger (a remote pdb that ``ray debug`` or any
    line-based socket client attaches to) instead of debugpy."""
    return os.environ.get("RAY_DEBUG") == "legacy"


def _remote_pdb(where: str, **extra: Any) -> Any:
    """Ray's remote pdb for this pause, once a client has connected. Ray records its
    address (for ``ray debug``) and blocks until a client connects; a thread reads that
    address and records the pause for the driver's ``[debug]`` line meanwhile."""
    import uuid

    from ray._private import ray_constants
    from ray.experimental import internal_kv
    from ray.util import rpdb

    key, stop = uuid.uuid4().hex, threading.Event()

    def announce() -> None:
        while not stop.is_set():
            raw = internal_kv._internal_kv_get(
                f"RAY_PDB_{key}", namespace=ray_constants.KV_NAMESPACE_PDB
            )
            if raw:
                host, port = json.loads(raw)["pdb_address"].rsplit(":", 1)
                return _announce(where, host, int(port), **extra)
            time.sleep(0.05)

    thread = threading.Thread(target=announce, name="polyrl-debug-announce", daemon=True)
    thread.start()
    try:
        rdb = rpdb._connect_ray_pdb(host=_state["config"].host, quiet=True, breakpoint_uuid=key)
    finally:
        stop.set()
        thread.join()
    _attached()
    return rdb


def pause(where: str, frame: Any) -> None:
    """Announce, wait for a debugger, then stop in ``frame`` (Ray's debugpy breakpoint,
    or its remote pdb with ``RAY_DEBUG=legacy``)."""
    if legacy():
        _remote_pdb(where).set_trace(frame=frame)
        return
    _announce(where, *_listen())
    _wait_for_client()
    import pydevd  # debugpy's vendored copy: importable once debugpy listens

    pydevd.settrace(stop_at_frame=frame)


def user_breakpoint(*args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` in a debugged process: pause in the caller's frame."""
    frame = sys._getframe(1)
    pause(f"{frame.f_code.co_filename}:{frame.f_lineno}", frame)


def _post_mortem(error: BaseException) -> None:
    """Pause on ``error`` where it began: in the frame that raised its root cause (an
    error raised ``from`` another, e.g. the RewardError wrapping your reward function's
    KeyError, pauses inside your function, with its locals)."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    tb = root.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb else "?"
    said = f"{type(error).__name__}: {error}"
    if legacy():
        rdb = _remote_pdb(where, error=said)
        rdb.reset()
        rdb.interaction(None, root.__traceback__)  # pdb.post_mortem on the root cause
        return
    _announce(where, *_listen(), error=said)
    _wait_for_client()
    import pydevd  # debugpy's vendored copy: importable once debugpy listens

    # What ray.util.debugpy does for an unhandled exception, on the root cause.
    py_db = pydevd.get_global_debugger()
    thread = threading.current_thread()
    info = py_db.set_additional_thread_info(thread)
    info.is_tracing += 1
    try:
        py_db.stop_on_unhandled_exception(
            py_db, thread, info, (type(root), root, root.__traceback__)
        )
    finally:
        info.is_tracing -= 1


def _stop_here(fn: Callable, ns: dict[str, Any]) -> None:
    """Stop in a frame whose locals are ``ns`` and whose file and line are ``fn``'s."""
    code = fn.__code__
    # The debugger stops at the next line of this frame: the pause call sits one line
    # above the method's first line, and the stop is on that line itself.
    line = max(code.co_firstlineno, 2)
    where = f"{code.co_filename}:{line}"
    src = "\n" * (line - 2) + "__polyrl_pause__(__polyrl_where__)\n__polyrl_resumed__ = True"
    ns = {**ns, "__polyrl_where__": where}
    glb = {"__polyrl_pause__": lambda w: pause(w, sys._getframe(1)), "__builtins__": __builtins__}
    exec(compile(src, code.co_filename, "exec"), glb, ns)


def _step(values: Any) -> int | None:
    """The training step of the call: a Batch argument carries it in its info dict."""
    for v in values:
        info = getattr(v, "info", None)
        if isinstance(info, dict):
            return info.get("step")
    return None


def _namespace(fn: Callable, method: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    ns = dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
    return ns | {"step": _step(ns.values()), "rank": _state["rank"], "role": _state["role"]}


def _check(expr: str | None, ns: dict[str, Any]) -> bool:
    return expr is None or bool(eval(expr, {}, ns))  # noqa: S307 (the user's own expression)


def _needs_result(expr: str | None, method: str) -> bool:
    names = set(compile(expr, "<cond>", "eval").co_names) if expr else set()
    return bool(names & {"result", RESULT_ALIAS.get(method, "result")})


def place(method: str) -> Callable[[Callable], Callable]:
    """Decorator of a role worker method: the breakpoints, log points and post-mortem of
    ``<role>.<method>`` (role from :func:`setup_worker`), a no-op without ``--debug``;
    and, always, the call's span for the run's timeline (``polyrl.observe.timeline.record``)."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return _debugged(fn, method, args, kwargs)
            finally:
                record(method, start, time.time() - start, _step((*args, *kwargs.values())))

        return wrapper

    return deco


def _debugged(fn: Callable, method: str, args: tuple, kwargs: dict) -> Any:
    cfg = _state["config"]
    if cfg is None:
        return fn(*args, **kwargs)
    points = cfg.points(_state["role"], method)
    ns = _namespace(fn, method, args, kwargs) if points else {}
    early = [(k, e) for k, e in points if not _needs_result(e, method)]
    _fire(fn, method, early, ns)
    try:
        result = fn(*args, **kwargs)
    except Exception as e:
        if cfg.post_mortem:
            _post_mortem(e)
        raise
    if len(early) < len(points):
        ns |= {"result": result, RESULT_ALIAS.get(method, "result"): result}
        _fire(fn, method, [p for p in points if p not in early], ns)
    return result


def _fire(fn: Callable, method: str, points: list, ns: dict[str, Any]) -> None:
    for kind, expr in points:
        if kind == "log":
            try:
                value = repr(eval(expr, {}, ns))  # noqa: S307
            except Exception as e:
                value = f"<{type(e).__name__}: {e}>"
            print(
                f"[debug] log point {_state['role']}.{method} rank {_state['rank']} "
                f"step {ns.get('step')}: {expr} = {value}",
                flush=True,
            )
        elif _check(expr, ns):
            _stop_here(fn, ns)


# ---------------------------------------------------------------- in the driver
class DebugSession:
    """The driver's side: prints a ``[debug]`` line for every pause the workers record,
    repeats ``nobody attached`` while one waits, and routes the driver's own
    ``breakpoint()`` through the same path."""

    def __init__(self, config: DebugConfig, echo: Callable[[str], Any] = print):
        self.config, self.echo = config, echo
        self.stop = threading.Event()
        _state.update(config=config, role="driver", rank=0)
        sys.breakpointhook = user_breakpoint
        threading.Thread(target=self._watch, name="polyrl-debug-watch", daemon=True).start()

    def _watch(self) -> None:
        from ray.experimental import internal_kv

        told: dict[str, float] = {}
        while not self.stop.wait(1.0):
            try:
                keys = internal_kv._internal_kv_list(KV_PREFIX)
                records = {k: internal_kv._internal_kv_get(k) for k in keys}
            except Exception:  # Ray is shutting down
                return
            now = time.monotonic()
            for key, raw in records.items():
                if raw is None:
                    continue
                r = json.loads(raw)
                if key not in told:
                    told[key] = now
                    self.echo(_line(r) + (f" ({r['error']})" if "error" in r else ""))
                elif now - told[key] >= self.config.report_every_s:
                    told[key] = now
                    waited = time.time() - r["since"]
                    self.echo(
                        f"[debug] {r['role']} rank {r['rank']} still paused at {r['where']}: "
                        f"nobody attached for {waited:.0f} s; attach to {r['host']}:{r['port']}"
                    )
            told = {k: t for k, t in told.items() if k in records}

    def close(self) -> None:
        self.stop.set()
        _state.update(config=None, role=None)
        sys.breakpointhook = sys.__breakpointhook__

    @classmethod
    def start(cls, config: DebugConfig | None) -> DebugSession | None:
        """A session when ``config`` is enabled (Ray must be up); prints the dashboard URL."""
        if config is None or not config.enabled:
            return None
        import ray

        if legacy():
            print(
                "[debug] Ray's terminal debugger on (RAY_DEBUG=legacy): attach to a pause with "
                "`ray debug`, or any line-based socket client (nc, telnet) at its address; "
                "docs/debugging.md",
                flush=True,
            )
            return cls(config)
        url = ray._private.worker.get_dashboard_url()
        print(
            f"[debug] Ray distributed debugger on; dashboard http://{url} (Ray Distributed "
            f"Debugger extension: add this cluster; docs/debugging.md)",
            flush=True,
        )
        return cls(config)


def for_debugging(cfg: Any, flag: bool = False) -> Any:
    """``cfg`` with its DebugConfig on when ``flag`` (``--debug``), and, when debugging,
    without the timeouts a paused worker would trip (rewards, rollout requests, env
    steps and agents; tools wait too, see :func:`debugging`)."""
    debug = cfg.debug or DebugConfig()
    if flag and not debug.enabled:
        debug = dataclasses.replace(debug, enabled=True)
    if not debug.enabled:
        return dataclasses.replace(cfg, debug=debug)
    year = 365 * 24 * 3600.0
    rollout = dataclasses.replace(cfg.rollout, request_timeout_s=year, ready_timeout_s=year)
    episodes = cfg.episodes and dataclasses.replace(
        cfg.episodes, env_timeout_s=year, agent_timeout_s=year
    )
    return dataclasses.replace(
        cfg, debug=debug, reward_timeout_s=None, rollout=rollout, episodes=episodes
    )
