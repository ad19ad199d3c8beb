"""The HTTP API the ``tinker`` Python client speaks (its ``/api/v1`` routes), on FastAPI,
over a :class:`polyrl.service.state.TinkerService`; ``polyrl serve-tinker`` starts it
(docs/tinker.md).

Requests that start work answer at once with a future (``{"request_id": ...}``); the
client polls ``/api/v1/retrieve_future``, which waits up to ``POLL_S`` for the result and
else answers ``try_again`` (the client polls again). Results are JSON, or protobuf for
forward/backward outputs and samples (the client asks for ``application/x-protobuf``).
A request the service cannot honour is a 400 with ``{"error": ..., "category": "user"}``
naming the field (at submission), or a failed future of that shape (when it runs); either
way the service goes on serving.

(No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations,
``Request`` among them, as objects.)
"""

import asyncio
import logging
from typing import Any

from polyrl.service.state import TinkerService
from polyrl.service.wire import RequestError

__all__ = ["CLIENT_CONFIG", "POLL_S", "make_app"]

log = logging.getLogger(__name__)

POLL_S = 20.0  # a retrieve_future waits this long before answering try_again
# The client's feature flags (tinker.types.ClientConfigResponse): plain API keys, the
# httpx transport, uncompressed protobuf forward/backward bodies, per-request polling.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


def _error(status: int, message: str, category: str = "user") -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message, "category": category}, status_code=status)


def _try_again(request_id: str) -> dict[str, Any]:
    """The answer to a poll that came before its result: the client polls again."""
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def make_app(service: TinkerService) -> Any:
    """The FastAPI application of ``service``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException
    from tinker import types

    app = FastAPI(title="polyrl Tinker-compatible service")

    @app.exception_handler(RequestError)
    async def _bad(request: Request, exc: RequestError) -> Any:
        return _error(400, str(exc))

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, exc: ValidationError) -> Any:
        fields = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return _error(400, f"{request.url.path}: {fields}")

    @app.exception_handler(HTTPException)
    async def _unknown(request: Request, exc: HTTPException) -> Any:
        if exc.status_code in (404, 405):  # a route this service does not have
            return _error(
                exc.status_code,
                f"{request.method} {request.url.path} is not served here (docs/tinker.md "
                "'Supported and not' lists what is)",
            )
        return _error(exc.status_code, f"{request.url.path}: {exc.detail}")

    @app.exception_handler(Exception)
    async def _broken(request: Request, exc: Exception) -> Any:
        log.exception("%s failed", request.url.path)
        return _error(400, f"{request.url.path}: {type(exc).__name__}: {exc}", "server")

    async def body(request: Request, model: type) -> Any:
        try:
            data = await request.json()
        except ValueError as e:
            raise RequestError(f"{request.url.path}: the body is no JSON ({e})") from e
        return model.model_validate(data)

    def future(rid: str, model_id: str | None = None) -> dict[str, Any]:
        return {"request_id": rid, **({"model_id": model_id} if model_id else {})}

    # ------------------------------------------------------------ session, config
    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.get("/api/v1/healthz")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return service.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await body(request, types.CreateSessionRequest)
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat() -> dict[str, Any]:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        await asyncio.to_thread(service.finish_session, session_id)
        return {}

    # -------------------------------------------------------------------- training
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req = await body(request, types.CreateModelRequest)
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise RequestError(
                f"optimizer_config.type={req.optimizer_config.type!r}: only AdamW is served"
            )
        rid = service.create_model(
            req.session_id, req.model_seq_id, req.base_model, req.lora_config, req.user_metadata
        )
        return future(rid)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return service.info((await body(request, types.GetInfoRequest)).model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        rid, model_id = await asyncio.to_thread(service.forward_backward, raw)
        return future(rid, model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        req = await body(request, types.OptimStepRequest)
        return future(service.optim_step(req.model_id, req.optim_params), req.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        req = await body(request, types.SaveWeightsRequest)
        return future(service.save_state(req.model_id, req.path), req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req = await body(request, types.LoadWeightsRequest)
        if req.model_id is not None:
            return future(service.load_state(req.model_id, req.path, req.optimizer), req.model_id)
        if req.session_id is None or req.model_seq_id is None:
            raise RequestError("load_weights needs model_id, or session_id and model_seq_id")
        rid = service.create_from_state(
            req.session_id,
            req.model_seq_id,
            req.path,
            req.optimizer,
            req.base_model,
            req.user_metadata,
        )
        return future(rid)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        req = await body(request, types.SaveWeightsForSamplerRequest)
        if req.kind != "snapshot":
            raise RequestError(f"kind={req.kind!r}: only 'snapshot' sampling clients are served")
        return future(service.save_for_sampler(req.model_id, req.path), req.model_id)

    # -------------------------------------------------------------------- sampling
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req = await body(request, types.CreateSamplingSessionRequest)
        sampler = service.create_sampler(req.model_path, req.base_model)
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler_info(sampler_id: str) -> dict[str, Any]:
        sampler = service.sampler(sampler_id)
        return {
            "sampler_id": sampler_id,
            "base_model": service.name,
            "model_path": sampler.model_path,
        }

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        req = await body(request, types.SampleRequest)
        rid, n = service.sample(req)
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}-{j}" for j in range(n)]}

    # ------------------------------------------------------------------------ REST
    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(service.training_run, run_id)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str) -> None:
        await asyncio.to_thread(service.delete_checkpoint, run_id, f"{kind}/{name}")

    # --------------------------------------------------------------------- futures
    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Any:
        req = await body(request, types.FutureRetrieveRequest)
        found = service.futures.get(req.request_id)
        if found is None:
            return _error(404, f"request_id={req.request_id!r} names no request of this service")
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(found)), POLL_S)
        except TimeoutError:
            return _try_again(req.request_id)
        except RequestError as e:
            return {"error": str(e), "category": "user"}
        except Exception as e:
            log.warning("request %s failed: %s: %s", req.request_id, type(e).__name__, e)
            return {"error": f"{type(e).__name__}: {e}", "category": "server"}
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return result

    return app
