"""The Tinker API's wire formats <-> polyrl: a forward_backward request's protobuf datums
as a :class:`polyrl.batch.Batch`, the per-datum log-probs and a sample's sequences as the
protobuf responses the ``tinker`` client decodes (its ``tinker.proto`` messages).

A datum is ``model_input`` (tokens ``x``, N of them) and ``loss_fn_inputs`` of N entries
each: ``target_tokens`` ``y`` (``y[i]`` is scored after ``x[:i+1]``), ``weights``,
``logprobs``, ``advantages``. In polyrl's sequence layout (``polyrl.batch``) that is the
prompt ``x[:1]`` and the response ``y``, which holds when ``y[:-1] == x[1:]`` (the next
token of each position, as every Tinker recipe builds its datums); other targets are
refused naming the datum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from polyrl.algos.tinker_losses import TINKER_LOSSES
from polyrl.batch import Batch, from_token_lists

__all__ = [
    "RequestError",
    "decode_forward_backward",
    "forward_backward_output",
    "sample_response",
    "tokens_of",
]

# Tinker's loss_fn_inputs name -> the batch column the losses read
_COLUMNS = {"weights": "weights", "logprobs": "sampling_logprobs", "advantages": "advantages"}


class RequestError(ValueError):
    """A request the service cannot honour: the message names the field and the fix. The
    client gets it as a 400 (at submission) or a failed future of category "user"."""


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def tokens_of(chunks: Sequence[Any], where: str) -> list[int]:
    """A model input's token ids (protobuf ``Chunk``s); text chunks only."""
    out: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise RequestError(
                f"{where}.chunks[{i}] is a {kind} chunk; this service serves text models "
                "(encoded_text chunks) only"
            )
        out += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return out


def _tensor(msg: Any, where: str) -> np.ndarray:
    pb = _pb()
    if msg.WhichOneof("encoding") != "dense":
        raise RequestError(f"{where} is sparse; send it dense (a plain list or array)")
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise RequestError(f"{where} has dtype {msg.dtype}; send float32 or int64")
    arr = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype])
    shape = list(msg.shape)
    if len(shape) > 1:
        raise RequestError(f"{where} has shape {shape}; one value per token ([N]) is served")
    return arr


def decode_forward_backward(
    body: bytes, pad_id: int
) -> tuple[Any, Batch, list[int], dict[str, Any]]:
    """The protobuf ``ForwardBackwardRequest`` -> (the message, the batch, each datum's
    length, its ``loss_fn_config``). Every field the loss needs is checked here, before
    anything runs."""
    request = _pb().ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError and friends
        raise RequestError(f"the forward_backward body is no ForwardBackwardRequest: {e}") from e
    loss = request.loss_fn
    if loss not in TINKER_LOSSES:
        raise RequestError(
            f"loss_fn={loss!r} is not served here; choose one of {sorted(TINKER_LOSSES)}"
        )
    if not request.data:
        raise RequestError("forward_backward_input.data is empty; send at least one Datum")
    needed = TINKER_LOSSES[loss][0]
    prompts, responses, lengths, columns = [], [], [], {_COLUMNS[k]: [] for k in needed}
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        x = tokens_of(datum.model_input, f"{where}.model_input")
        inputs = datum.loss_fn_inputs
        missing = [k for k in ("target_tokens", *needed) if k not in inputs]
        if missing:
            raise RequestError(
                f"{where}.loss_fn_inputs lacks {missing}, which loss_fn={loss!r} needs"
            )
        y = _tensor(inputs["target_tokens"], f"{where}.loss_fn_inputs['target_tokens']")
        if not x or len(y) != len(x):
            raise RequestError(
                f"{where}: target_tokens has {len(y)} entries for {len(x)} input tokens; "
                "send one target per input token (and at least one)"
            )
        if not np.array_equal(y[:-1], np.asarray(x[1:])):
            raise RequestError(
                f"{where}: target_tokens is not model_input shifted by one "
                "(target_tokens[i] == model_input[i + 1]); this service trains next-token "
                "targets only"
            )
        for key in needed:
            value = _tensor(inputs[key], f"{where}.loss_fn_inputs[{key!r}]")
            if len(value) != len(x):
                raise RequestError(
                    f"{where}.loss_fn_inputs[{key!r}] has {len(value)} entries for {len(x)} tokens"
                )
            columns[_COLUMNS[key]].append(value.astype(np.float32))
        prompts.append(x[:1])
        responses.append(y.tolist())
        lengths.append(len(x))
    batch = from_token_lists(prompts, responses, pad_id)
    width = batch["responses"].shape[1]
    padded = {
        name: np.stack([np.pad(v, (0, width - len(v))) for v in values])
        for name, values in columns.items()
    }
    config = {
        key: getattr(value, value.WhichOneof("value") or "number")
        for key, value in request.loss_fn_config_v2.items()
    } or dict(request.loss_fn_config)
    return request, batch.with_columns(padded), lengths, config


def _batched(arrays: Sequence[np.ndarray]) -> Any:
    """Per-datum float32 arrays as one protobuf ``BatchedTensor`` (byte offsets)."""
    pb = _pb()
    data = [np.asarray(a, dtype=np.float32) for a in arrays]
    offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in data])]).astype(np.int64)
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in data),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32,
        trailing_shape=[],
    )


def forward_backward_output(
    log_probs: np.ndarray, lengths: Sequence[int], metrics: dict[str, float]
) -> bytes:
    """The protobuf ``ForwardBackwardOutput``: each datum's target log-probs
    (``loss_fn_outputs[i]["logprobs"]``) and the metrics."""
    pb = _pb()
    record = pb.ArrayRecord(
        type_tag="ArrayRecord",
        num_datums=len(lengths),
        fields={"logprobs": _batched([log_probs[i, :n] for i, n in enumerate(lengths)])},
    )
    out = pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics
    )
    return out.SerializeToString()


def sample_response(results: Sequence[dict[str, Any]], prompt_logprobs: bool) -> bytes:
    """The protobuf ``SampleResponse`` of one request's samples (``RolloutServer.generate``
    results; their ``prompt_log_probs`` when asked for, NaN first)."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse(
        sequences=[
            pb.SampledSequence(
                stop_reason=reasons.get(r["finish_reason"], pb.STOP_REASON_STOP),
                tokens=np.asarray(r["token_ids"], dtype=np.int32).tobytes(),
                logprobs=np.asarray(r["log_probs"], dtype=np.float32).tobytes(),
            )
            for r in results
        ]
    )
    if prompt_logprobs:
        out.prompt_logprobs = np.asarray(results[0]["prompt_log_probs"], np.float32).tobytes()
    return out.SerializeToString()
