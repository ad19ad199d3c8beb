"""The backend-neutral checkpoint exchange: how a run written by one training backend
resumes on the other (docs/training.md "Resuming on the other backend").

Same-backend resume reads the backend's own checkpoint (DCP, orbax). Across backends,
``polyrl.checkpoints.restore`` converts each trained role's checkpoint into this format
first (:func:`convert`: the writing backend's exporter, in a process of its own, so
neither backend imports the other's framework) and the resuming engine's ``load`` reads
it. An exchange directory holds::

    exchange.json             step (engine updates), adam_step (Adam's bias-correction
                              count), role, model shape, source backend
    params.safetensors        fp32 weights under Hugging Face names
    exp_avg.safetensors       Adam's first moment, same names (absent: frozen role)
    exp_avg_sq.safetensors    Adam's second moment

Every array is fp32 as both backends keep their masters and moments, so weights and
optimizer state carry over bit for bit; :data:`NOT_CARRIED` names what does not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Exchange",
    "write",
    "read",
    "read_info",
    "is_exchange",
    "convert",
    "NOT_CARRIED",
    "MOMENTS",
]

INFO = "exchange.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = 1

# Printed once when a run resumes on the other backend.
NOT_CARRIED = (
    "weights, Adam moments and step counts, the data position, sampling seeds and loop "
    "state carry over exactly; not carried: torch_fsdp's per-rank torch RNG state (jax_pjit "
    "keeps none; polyrl's models draw no random numbers in training), and the next steps "
    "differ from a same-backend resume by the backends' rounding (fp32 ~1e-6 relative per "
    "step, more in bf16)"
)


@dataclasses.dataclass
class Exchange:
    """One trained role's state: ``params`` / ``moments[name]`` map HF names to fp32
    arrays (``moments`` empty for a frozen role); ``info`` is exchange.json."""

    params: dict[str, np.ndarray]
    moments: dict[str, dict[str, np.ndarray]]
    info: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def adam_step(self) -> int:
        return int(self.info["adam_step"])


def write(path: str | os.PathLike, state: Exchange) -> None:
    """Write ``state`` under directory ``path`` (exchange.json last: complete when there)."""
    from safetensors.numpy import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for name, arrays in {"params": state.params, **state.moments}.items():
        save_file(
            {k: np.ascontiguousarray(v, np.float32) for k, v in arrays.items()},
            str(out / f"{name}.safetensors"),
        )
    (out / INFO).write_text(json.dumps({"format": FORMAT, **state.info}, indent=1))


def is_exchange(path: str | os.PathLike) -> bool:
    return Path(path, INFO).is_file()


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """exchange.json: step, adam_step, role, model shape, source backend."""
    return json.loads(Path(path, INFO).read_text())


def read(path: str | os.PathLike, names: set[str] | None = None) -> Exchange:
    """The state :func:`write` put under ``path``. With ``names`` (the loading engine's
    parameter names) every one must be there, with Adam moments when there are moments;
    a missing one raises naming it."""
    from safetensors.numpy import load_file

    root = Path(path)
    info = read_info(root)
    params = load_file(str(root / "params.safetensors"))
    moments = {
        m: load_file(str(root / f"{m}.safetensors"))
        for m in MOMENTS
        if (root / f"{m}.safetensors").is_file()
    }
    if names is not None:
        for what, arrays in {"params": params, **moments}.items():
            missing = sorted(names - set(arrays))
            if missing:
                raise ValueError(
                    f"exchange checkpoint {root} ({info.get('source_backend')}) has no {what} "
                    f"for {len(missing)} parameter(s) of this model, e.g. {missing[:3]}; it was "
                    "written for another model (polyrl.RunConfig.model_path)"
                )
    return Exchange(params, moments, info)


def convert(backend: str, src: str | os.PathLike, out: str | os.PathLike) -> None:
    """Convert ``backend``'s engine checkpoint at ``src`` into an exchange directory
    ``out``, in a child process that imports only that backend (on the host's CPU)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "polyrl.backends.exchange", backend, str(src), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"converting the {backend} checkpoint {src} for the other backend failed "
            f"(exit {done.returncode}):\n{done.stderr[-3000:]}"
        )


def _main(backend: str, src: str, out: str) -> None:
    import importlib

    from polyrl.backends.base import get_backend

    module, _, fn = get_backend(backend).exporter.partition(":")
    state = getattr(importlib.import_module(module), fn)(src)
    state.info["source_backend"] = backend
    write(out, state)


if __name__ == "__main__":
    _main(*sys.argv[1:4])
