"""What the Tinker-compatible service holds and does: training models (each an actor
:class:`polyrl.cluster.workers.EngineGroup`, LoRA adapters on the served model), sampling
sessions (weights pushed into the run's :class:`polyrl.rollout.RolloutPool`), and the
futures a client polls.

Every training request of one model runs in its own single thread, in arrival order (the
``tinker`` client sends a model's requests one after the other, in seq order); samples of
all sessions go through one dispatcher that takes whatever has queued up, groups it by
weights and sampling settings and sends each group to the pool in one call, without
waiting for the calls before it: calls on the weights the pool holds are in flight
together (the servers' asynchronous engine schedules them as one batch). A sampling
session names its weights (the base model, a snapshot exported from a training model, or
a directory saved for sampling); the pool holds one set at a time, so a group of another
session's samples waits for the calls in flight to end, then pushes its session's weights
(``RolloutPool.update_weights``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import itertools
import json
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.algos.tinker_losses import tinker_loss
from polyrl.config import LoraConfig, OptimConfig
from polyrl.service.wire import (
    RequestError,
    decode_forward_backward,
    forward_backward_output,
    sample_response,
)

__all__ = ["TinkerService"]

log = logging.getLogger(__name__)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32.0  # Tinker's adapters' alpha, whatever the rank
KEEP_FUTURES = 10_000  # finished futures kept for clients that poll again
# Weight snapshots (save_weights_and_get_sampling_client) kept in the driver's memory, the
# newest first: an RL loop makes one a round. An older sampling client still samples
# while the rollout servers hold its weights; after that it is refused by name.
KEEP_SNAPSHOTS = 4
SCHEME = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment: checkpoint type
RUN_FILE = "run.json"  # a training run's record, in its directory


class Futures:
    """Request id -> ``concurrent.futures.Future`` whose result is the response: a dict
    (JSON) or bytes (protobuf). The newest ``KEEP_FUTURES`` are kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: collections.OrderedDict[str, cf.Future] = collections.OrderedDict()
        self._ids = itertools.count()

    def add(self, future: cf.Future) -> str:
        with self._lock:
            rid = f"req-{next(self._ids)}"
            self._all[rid] = future
            while len(self._all) > KEEP_FUTURES:
                self._all.popitem(last=False)
        return rid

    def get(self, rid: str) -> cf.Future | None:
        with self._lock:
            return self._all.get(rid)


@dataclasses.dataclass
class TrainingModel:
    model_id: str
    lora: LoraConfig
    executor: cf.ThreadPoolExecutor
    group: Any = None  # the EngineGroup, once created
    saves: int = 0


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A sampling session: ``key`` names the weights it samples (what the pool must hold),
    ``buckets`` gives them for a push."""

    sampler_id: str
    model_path: str | None
    key: str
    buckets: Callable[[], list]


def _lora_file(state: Path) -> Path:
    """Beside a saved state: the LoRA settings a model loading it must have."""
    return state.parent / f"{state.name}.lora.json"


def _fail(group: list, error: BaseException) -> None:
    """Every sample request of ``group`` fails with ``error``."""
    for item in group:
        item[5].set_exception(error)


def _iso(mtime: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(mtime, datetime.UTC).isoformat()


def _dir_buckets(path: Path) -> Callable[[], list]:
    """An HF directory's safetensors as weight buckets (one per file)."""

    def load() -> list:
        from safetensors.torch import load_file

        return [list(load_file(str(f)).items()) for f in sorted(path.glob("*.safetensors"))]

    return load


class TinkerService:
    """The service's state. ``actor``: the run's actor RoleSpec (``polyrl.cluster.roles``),
    the template of every training model; ``pool``: the started RolloutPool; ``state_dir``:
    where saved states and sampler weights go; ``name``: the served model's name;
    ``placement``: the run's ``polyrl.cluster.placement.Placement`` (each training model's
    workers ask for ``1/settings.max_training_clients`` of the actor's share of it);
    ``settings``: the ``polyrl.service.TinkerConfig``."""

    def __init__(
        self,
        actor: Any,
        pool: Any,
        state_dir: Path,
        name: str,
        max_model_len: int,
        placement: Any,
        settings: Any,
    ):
        self.actor, self.pool, self.name = actor, pool, name
        self.placement, self.settings = placement, settings
        self.state_dir = Path(state_dir)
        self.model_path = Path(actor.model.path).resolve()
        self.max_model_len = max_model_len
        self.futures = Futures()
        self._lock = threading.Lock()
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.snapshots: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.sessions: set[str] = set()
        self.loaded = str(self.model_path)  # the weights the pool holds (a Sampler.key)
        self._inflight = 0  # pool calls on the loaded weights not yet returned
        self._idle = threading.Condition()  # guards loaded and _inflight
        self.pad_id = 0
        self._samples: queue.Queue = queue.Queue()
        self._dispatcher = threading.Thread(target=self._sample_loop, daemon=True)
        self._dispatcher.start()

    # ------------------------------------------------------------------ helpers
    def _future(self, fn: Callable[[], Any], executor: cf.Executor) -> str:
        return self.futures.add(executor.submit(fn))

    def _find(self, table: dict, key: str, missing: str) -> Any:
        """``table[key]``, read under the service's lock; a RequestError saying ``missing``
        if it is not there."""
        with self._lock:
            found = table.get(key)
        if found is None:
            raise RequestError(missing)
        return found

    def model(self, model_id: str) -> TrainingModel:
        return self._find(
            self.models,
            model_id,
            f"model_id={model_id!r} names no training model of this service "
            "(create_lora_training_client first)",
        )

    def check_base_model(self, base_model: str | None) -> None:
        """The served model is named by its name or by its directory, in any spelling of
        the path (relative to the service's directory, absolute, a trailing '/'): a
        recipe's ``model_name`` is the directory its tokenizer loads from."""
        if base_model in (self.name, None):
            return
        if Path(base_model).expanduser().resolve() != self.model_path:
            raise RequestError(
                f"base_model={base_model!r} is not served here; this service serves "
                f"{self.name!r} ({self.model_path})"
            )

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": self.name,
                    "max_context_length": self.max_model_len,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    def create_session(self) -> str:
        session = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions.add(session)
        return session

    # ------------------------------------------------------------ training models
    @staticmethod
    def lora_config(lora: Any) -> LoraConfig:
        """The client's ``LoraConfig`` as polyrl's (alpha 32, projections by flag)."""
        if lora is None:
            raise RequestError("lora_config is missing; this service trains LoRA adapters")
        targets = (ATTN if lora.train_attn else ()) + (MLP if lora.train_mlp else ())
        if not targets:
            raise RequestError(
                "lora_config: train_attn and train_mlp are both False; adapters go on the "
                "attention and/or MLP projections here (the unembedding gets none)"
            )
        if lora.rank < 1:
            raise RequestError(f"lora_config.rank={lora.rank} must be >= 1")
        return LoraConfig(rank=lora.rank, alpha=LORA_ALPHA, target_modules=targets)

    def _new_model(
        self, session_id: str, seq_id: int, config: LoraConfig, metadata: dict | None
    ) -> TrainingModel:
        """Register a training model and write its run's record (``run.json`` in its
        directory: what ``get_training_run`` answers, also after a restart)."""
        model_id = f"{session_id}:train:{seq_id}"
        model = TrainingModel(model_id, config, cf.ThreadPoolExecutor(1, f"tinker-{seq_id}"))
        with self._lock:
            if session_id not in self.sessions:
                raise RequestError(
                    f"session_id={session_id!r} names no open session of this service "
                    "(a new ServiceClient opens one)"
                )
            if model_id in self.models:
                raise RequestError(f"model_seq_id={seq_id} already names a model of this session")
            most = self.settings.max_training_clients
            if len(self.models) >= most:
                raise RequestError(
                    f"this service serves {most} training clients at once "
                    f"(polyrl.TinkerConfig.max_training_clients={most}, each with 1/{most} of "
                    "the actor's share of its pool) and all are in use; close a session "
                    "(ServiceClient.close) or restart the service with a larger "
                    "polyrl.TinkerConfig.max_training_clients"
                )
            self.models[model_id] = model
        record = {
            "lora_rank": config.rank,
            "user_metadata": {str(k): str(v) for k, v in (metadata or {}).items()},
        }
        self.run_dir(model_id).mkdir(parents=True, exist_ok=True)
        (self.run_dir(model_id) / RUN_FILE).write_text(json.dumps(record))
        return model

    def _start(self, model: TrainingModel) -> None:
        """Start the model's workers; a model that fails to start is forgotten (its id
        then names nothing) and the failure is its creation's."""
        from polyrl.cluster.workers import EngineGroup

        lora = dataclasses.replace(self.actor.model, lora=model.lora)
        split = self.settings.max_training_clients
        options = functools.partial(self.placement.options, self.actor.name, split=split)
        try:
            model.group = EngineGroup(dataclasses.replace(self.actor, model=lora), options)
        except BaseException:
            with self._lock:
                self.models.pop(model.model_id, None)
            raise

    def create_model(
        self, session_id: str, seq_id: int, base_model: str, lora: Any, metadata: dict | None
    ) -> str:
        """Start a training model (a future: its workers take seconds to start)."""
        self.check_base_model(base_model)
        model = self._new_model(session_id, seq_id, self.lora_config(lora), metadata)
        if lora.train_unembed:
            log.info(
                "%s: train_unembed is accepted; the unembedding gets no adapter", model.model_id
            )

        def start() -> dict[str, Any]:
            self._start(model)
            return {"model_id": model.model_id, "type": "create_model"}

        return self._future(start, model.executor)

    def create_from_state(
        self,
        session_id: str,
        seq_id: int,
        uri: str,
        optimizer: bool,
        base_model: str | None,
        metadata: dict | None,
    ) -> str:
        """``create_training_client_from_state[_with_optimizer]``: a training model with the
        saved state's adapters (its LoRA settings from the save), then its load."""
        self.check_base_model(base_model)
        path = self.local(uri)
        sidecar = _lora_file(path)
        if not sidecar.exists():
            raise RequestError(f"path={uri!r}: no state was saved there (save_state writes one)")
        config = LoraConfig(**json.loads(sidecar.read_text()))
        model = self._new_model(session_id, seq_id, config, metadata)

        def run() -> dict[str, Any]:
            self._start(model)
            return self._load(model, path, uri, optimizer)

        return self._future(run, model.executor)

    def info(self, model_id: str) -> dict[str, Any]:
        model = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_name": self.name,
            "model_data": {
                "arch": "causal_lm",
                "model_name": self.name,
                "tokenizer_id": str(self.model_path),
            },
            "is_lora": True,
            "lora_rank": model.lora.rank,
        }

    def forward_backward(self, body: bytes) -> tuple[str, str]:
        """Decode and check the request now (a bad one is a 400), run it in the model's
        thread: ``TrainEngine.forward_backward``, or for ``forward_only`` a no-grad forward
        whose loss the same loss function computes on the host. (request id, model id)."""
        request, batch, lengths, config = decode_forward_backward(body, self.pad_id)
        try:
            loss = tinker_loss(request.loss_fn, config)
        except ValueError as e:
            raise RequestError(str(e)) from e
        model = self.model(request.model_id)

        def run() -> bytes:
            workers = model.group.num_workers
            padded = batch.pad_to_multiple(workers) if len(batch) % workers else batch
            if "is_pad" in padded:  # pad rows: nothing to score or to learn
                keep = 1.0 - padded["is_pad"].astype(np.float32)[:, None]
                padded = padded.with_columns({k: padded[k] * keep for k in _MASKED if k in padded})
            if request.forward_only:
                out = model.group.forward(padded)
                value, _ = loss(out, {k: padded[k] for k in padded.tensors})
                out = {"log_probs": out["log_probs"], "loss": float(value)}
            else:
                out = model.group.forward_backward(padded, loss)
            metrics = {"loss:sum": float(out["loss"])}
            return forward_backward_output(out["log_probs"][: len(batch)], lengths, metrics)

        return self._future(run, model.executor), request.model_id

    def optim_step(self, model_id: str, adam: Any) -> str:
        model = self.model(model_id)
        if getattr(adam, "type", "adam") not in ("adam", "adamw"):
            raise RequestError(f"optim_params type {adam.type!r} is not served; send AdamParams")
        try:
            optim = OptimConfig(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
                grad_clip=adam.grad_clip_norm or None,
            )
        except ValueError as e:
            raise RequestError(f"adam_params: {e}") from e

        def run() -> dict[str, Any]:
            out = model.group.optim_step(optim)
            return {"metrics": {f"{k}:mean": float(v) for k, v in out.items()}}

        return self._future(run, model.executor)

    def _path(self, model: TrainingModel, kind: str, name: str | None) -> tuple[str, Path]:
        if name is None:
            model.saves += 1
            name = f"{kind}-{model.saves:06d}"
        if not name or "/" in name or name.startswith("."):
            raise RequestError(f"path={name!r} must be a plain name (no '/')")
        uri = f"{SCHEME}{model.model_id}/{kind}/{name}"
        return uri, self.local(uri)

    def local(self, uri: str) -> Path:
        """The directory a ``tinker://<model id>/<kind>/<name>`` path names here."""
        if not uri.startswith(SCHEME) or uri.count("/") != 4:
            raise RequestError(
                f"path={uri!r} is no {SCHEME}<model id>/<weights|sampler_weights>/<name> path "
                "of this service"
            )
        model_id, kind, name = uri[len(SCHEME) :].split("/")
        if kind not in KINDS:
            raise RequestError(f"path={uri!r}: {kind!r} is not 'weights' or 'sampler_weights'")
        if not name or name.startswith("."):
            raise RequestError(f"path={uri!r}: {name!r} is no checkpoint name")
        return self.run_dir(model_id) / kind / name

    def run_dir(self, run_id: str) -> Path:
        """The directory of a training run's (a model id's) record and saves."""
        if not run_id or run_id.startswith(".") or "/" in run_id:
            raise RequestError(f"training_run_id={run_id!r} names no training run")
        return self.state_dir / run_id.replace(":", "_")

    def _saved(self, run_id: str, kind: str) -> list[Path]:
        """A run's saves of one kind (complete ones: a state's LoRA settings or a sampler
        directory's config are written last)."""
        found = self.run_dir(run_id) / kind
        done = "{}.lora.json" if kind == "weights" else "{}/config.json"
        if not found.is_dir():
            return []
        return [p for p in found.iterdir() if p.is_dir() and (found / done.format(p.name)).exists()]

    def training_run(self, run_id: str) -> dict[str, Any]:
        """``RestClient.get_training_run[_by_tinker_path]``: the run's record, its newest
        state and sampler weights (a recipe reads the renderer name it was trained with
        from ``user_metadata`` before it resumes)."""
        record = self.run_dir(run_id) / RUN_FILE
        if not record.exists():
            raise RequestError(f"training_run_id={run_id!r} names no training run of this service")
        info = json.loads(record.read_text())
        saved = {kind: self._saved(run_id, kind) for kind in KINDS}
        newest = {}
        for kind, label in KINDS.items():
            last = max(saved[kind], key=lambda p: p.stat().st_mtime, default=None)
            newest[kind] = last and {
                "checkpoint_id": f"{kind}/{last.name}",
                "checkpoint_type": label,
                "time": _iso(last.stat().st_mtime),
                "tinker_path": f"{SCHEME}{run_id}/{kind}/{last.name}",
            }
        times = [record.stat().st_mtime] + [p.stat().st_mtime for k in KINDS for p in saved[k]]
        return {
            "training_run_id": run_id,
            "base_model": self.name,
            "model_owner": "local",
            "is_lora": True,
            "lora_rank": info["lora_rank"],
            "last_request_time": _iso(max(times)),
            "last_checkpoint": newest["weights"],
            "last_sampler_checkpoint": newest["sampler_weights"],
            "user_metadata": info["user_metadata"] or None,
        }

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """``RestClient.delete_checkpoint[_from_tinker_path]`` (a recipe's rolling saves):
        the save's directory and its LoRA settings go."""
        import shutil

        uri = f"{SCHEME}{run_id}/{checkpoint_id}"
        path = self.local(uri)
        if not path.is_dir():
            raise RequestError(f"checkpoint {uri!r} names no checkpoint of this service")
        _lora_file(path).unlink(missing_ok=True)
        shutil.rmtree(path)

    def save_state(self, model_id: str, name: str | None) -> str:
        model = self.model(model_id)
        uri, path = self._path(model, "weights", name)

        def run() -> dict[str, Any]:
            path.parent.mkdir(parents=True, exist_ok=True)
            model.group.call_all("save", str(path))
            lora = model.lora
            settings = {
                "rank": lora.rank,
                "alpha": lora.alpha,
                "target_modules": lora.target_modules,
            }
            _lora_file(path).write_text(json.dumps(settings))
            return {"path": uri, "type": "save_weights"}

        return self._future(run, model.executor)

    def _load(self, model: TrainingModel, path: Path, uri: str, optimizer: bool) -> dict:
        if not _lora_file(path).exists():
            raise RequestError(f"path={uri!r}: no state was saved there (save_state writes one)")
        model.group.call_all("load", str(path))
        if not optimizer:  # the weights alone: a fresh optimizer on them
            model.group.call_all("reset_optimizer")
        return {"path": uri, "model_id": model.model_id, "type": "load_weights"}

    def load_state(self, model_id: str, uri: str, optimizer: bool) -> str:
        """``load_state`` (weights; a fresh optimizer) or ``load_state_with_optimizer``."""
        model = self.model(model_id)
        path = self.local(uri)
        return self._future(lambda: self._load(model, path, uri, optimizer), model.executor)

    def save_for_sampler(self, model_id: str, name: str | None) -> str:
        """With a name: an HF directory a later ``create_sampling_client(model_path)`` reads;
        without: a snapshot of the current weights and a sampling session on it."""
        model = self.model(model_id)
        uri, path = self._path(model, "sampler_weights", name)

        def run() -> dict[str, Any]:
            if name is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                model.group.export_hf(str(path))
                return {"path": uri, "type": "save_weights_for_sampler"}
            buckets = model.group.host_buckets(1 << 28)
            with self._lock:
                self.snapshots[uri] = buckets
                while len(self.snapshots) > KEEP_SNAPSHOTS:
                    self.snapshots.popitem(last=False)
            sampler = self._add_sampler(uri, uri, functools.partial(self._snapshot, uri))
            return {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}

        return self._future(run, model.executor)

    def _snapshot(self, uri: str) -> list:
        return self._find(
            self.snapshots,
            uri,
            f"the weights of this sampling client ({uri}) were dropped: the service keeps "
            f"the newest {KEEP_SNAPSHOTS} snapshots; create a new sampling client (or "
            "save_weights_for_sampler(name) for weights to keep)",
        )

    def finish_session(self, session_id: str) -> None:
        """The client closed its session: its training models end (their workers go)."""
        with self._lock:
            self.sessions.discard(session_id)
            ending = [m for k, m in self.models.items() if k.startswith(f"{session_id}:")]
            for model in ending:
                del self.models[model.model_id]
        for model in ending:
            model.executor.shutdown(wait=True)
            if model.group is not None:
                model.group.shutdown()

    # ------------------------------------------------------------------ sampling
    def _add_sampler(self, model_path: str | None, key: str, buckets: Callable) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.samplers[sampler_id] = Sampler(sampler_id, model_path, key, buckets)
        return sampler_id

    def create_sampler(self, model_path: str | None, base_model: str | None) -> str:
        if model_path is None:
            self.check_base_model(base_model)
            return self._add_sampler(None, str(self.model_path), _dir_buckets(self.model_path))
        path = self.local(model_path)
        if not (path / "config.json").exists():
            raise RequestError(
                f"model_path={model_path!r}: no sampler weights were saved there "
                "(save_weights_for_sampler(name) writes them)"
            )
        return self._add_sampler(model_path, str(path), _dir_buckets(path))

    def sampler(self, sampler_id: str) -> Sampler:
        return self._find(
            self.samplers,
            sampler_id,
            f"sampling_session_id={sampler_id!r} names no sampling session",
        )

    def sample(self, request: Any) -> tuple[str, int]:
        """Queue one sample request; (request id, samples it will hold)."""
        from polyrl.rollout import SamplingSpec

        sampler = self.sampler(request.sampling_session_id)
        params = request.sampling_params
        try:
            prompt = request.prompt.to_ints()
        except Exception as e:
            raise RequestError(f"prompt: {e}; this service serves text prompts only") from e
        unsupported = {
            "topk_prompt_logprobs": request.topk_prompt_logprobs,
            "topk_sample_logprobs": request.topk_sample_logprobs,
            "target_prompt_logprobs": request.target_prompt_logprobs,
            "prompt_alt_tokens_k": request.prompt_alt_tokens_k,
            "prompt_logprobs_last_n": request.prompt_logprobs_last_n,
        }
        asked = [k for k, v in unsupported.items() if v]
        if asked:
            raise RequestError(f"{asked[0]} is not served here; leave it unset")
        stop = params.stop
        if isinstance(stop, str) or (stop and any(isinstance(s, str) for s in stop)):
            raise RequestError(
                f"sampling_params.stop={stop!r}: stop strings are not served; pass token ids"
            )
        room = self.max_model_len - len(prompt)
        if not prompt or room < 1:
            raise RequestError(
                f"prompt has {len(prompt)} tokens; this service takes 1 to "
                f"{self.max_model_len - 1} (its max_model_len is {self.max_model_len})"
            )
        if request.num_samples < 1:
            raise RequestError(f"num_samples={request.num_samples} must be >= 1")
        try:
            spec = SamplingSpec(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=max(params.top_k, 0),
                max_tokens=self.max_model_len,
                stop_token_ids=tuple(stop or ()),
                seed=params.seed,
                ignore_eos=stop == [],
                detokenize=False,
                prompt_logprobs=bool(request.prompt_logprobs),
            )
        except ValueError as e:
            raise RequestError(f"sampling_params: {e}") from e
        cap = min(params.max_tokens or room, room)
        future: cf.Future = cf.Future()
        rid = self.futures.add(future)
        self._samples.put((sampler, spec, prompt, request.num_samples, cap, future))
        return rid, request.num_samples

    SAMPLE_CALLS = 32  # pool calls in flight at once, at most

    def _sample_loop(self) -> None:
        with cf.ThreadPoolExecutor(self.SAMPLE_CALLS, thread_name_prefix="sample") as calls:
            while True:
                items = [self._samples.get()]
                while not self._samples.empty():
                    items.append(self._samples.get())
                groups: dict[tuple, list] = {}
                for item in (i for i in items if i is not None):
                    groups.setdefault((item[0].key, item[1]), []).append(item)
                for group in groups.values():
                    if self._hold_weights(group):
                        calls.submit(self._sample_group, group)
                if None in items:
                    return  # the executor's exit waits for the calls in flight

    def _hold_weights(self, group: list) -> bool:
        """Make the pool hold ``group``'s weights, once no call on others is in flight, and
        count the group's call in flight; False (the group's futures failed) if the push
        failed."""
        sampler = group[0][0]
        with self._idle:
            self._idle.wait_for(lambda: self.loaded == sampler.key or not self._inflight)
            if self.loaded != sampler.key:
                try:
                    self.pool.update_weights(sampler.buckets())
                except Exception as e:
                    _fail(group, e)
                    return False
                self.loaded = sampler.key
            self._inflight += 1
        return True

    def _sample_group(self, group: list) -> None:
        spec = group[0][1]
        try:
            requests = [(j, prompt, cap) for _, _, prompt, n, cap, _ in group for j in range(n)]
            results = self.pool.generate_ids(requests, spec)
        except Exception as e:
            _fail(group, e)
            return
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()
        start = 0
        for _, _, _, n, _, future in group:
            future.set_result(sample_response(results[start : start + n], spec.prompt_logprobs))
            start += n

    def shutdown(self) -> None:
        self._samples.put(None)
        self._dispatcher.join(timeout=30)
        for model in list(self.models.values()):
            model.executor.shutdown(wait=True)
            if model.group is not None:
                model.group.shutdown()
        self.pool.shutdown()
        self.placement.release()  # last: removing a group kills what still runs in it


_MASKED = ("response_mask", "weights", "advantages")  # zero on pad rows
