"""What an ingress stores of a request for its adopter (meta ``req``; SPEC P4, L5): a typed,
versioned JSON encoding of the :class:`~coda.engine.types.GenerationRequest` and when it was
accepted, never a pickle.

The durable log is a shared store: whoever can write to that Redis could otherwise run code in
every front end that adopts (``pickle.loads``). A stored request is data only:

``{"kind": "coda.request", "v": 1, "accepted": <unix s>, "req": {<field>: <value>, ...}}``

with one entry per field of :class:`~coda.engine.types.GenerationRequest` and of the
dataclasses it holds (:class:`~coda.sampling.SamplingParams`,
:class:`~coda.early_stop.EarlyStopPolicy`, :class:`~coda.engine.types.GrammarSpec`,
:class:`~coda.stream_backpressure.BackpressureConfig`, :class:`~coda.reasoning.ReasoningSpec`), each
written by an explicit field codec (tuples as arrays, bytes as hex, an enum by its value).
:func:`decode_stored` checks the envelope, the version, that each object has exactly its
class's fields and that each value has its field's JSON type, then builds the dataclasses
(whose own validation runs); anything else (another version, a wrong type, a pickle, not
JSON) raises :class:`StoredRequestError`, and nothing of it is executed. A field added to one
of those dataclasses must be added to its table here (``tests/test_request_codec.py`` fails
until it is).

Rolling upgrades (P4): version 1 only grows. A field added after version 1 shipped is listed in
:data:`ADDED_IN_V1` with the value that reproduces what a front end without it did, and a
record lacking it (stored by such a front end) decodes with that value, so a new front end
adopts an old one's orphans. A record with a field this front end does not know (stored by a
newer one) is refused, never run with that field dropped: it is left to a front end that reads
it. A change that cannot be read that way (a field removed or retyped) is a new ``VERSION``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from coda.early_stop import EarlyStopPolicy
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.errors import InvalidRequestError
from coda.reasoning import ReasoningSpec
from coda.sampling import SamplingParams
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy

KIND = "coda.request"
VERSION = 1


class StoredRequestError(ValueError):
    """A stored request this front end does not read (another version, a field missing, extra
    or of the wrong type, not this codec's JSON: a pickle); refused, never executed."""


@dataclass(frozen=True)
class FieldCodec:
    """One field: ``encode`` to a JSON value, ``decode`` back, checking its type (raising
    :class:`StoredRequestError` naming ``where``)."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any, str], Any]


def _fail(where: str, want: str, got: object) -> StoredRequestError:
    return StoredRequestError(f"{where}: expected {want}, got {type(got).__name__}")


def _same(value: Any) -> Any:
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, "an integer", value)
    return value


def _float(value: Any, where: str) -> float:
    # NOTE: a whole float is written "1.0" but another writer may write 1; both are numbers
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, "a number", value)
    if not math.isfinite(value):
        raise StoredRequestError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "a boolean", value)
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, "a string", value)
    return value


def _hex(value: Any, where: str) -> bytes:
    try:
        return bytes.fromhex(_str(value, where))
    except ValueError:
        raise StoredRequestError(f"{where}: expected hex bytes") from None


def _object(value: Any, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise _fail(where, "an object", value)
    return value


SCALAR_INT = FieldCodec(_same, _int)
SCALAR_FLOAT = FieldCodec(float, _float)
SCALAR_BOOL = FieldCodec(_same, _bool)
SCALAR_STR = FieldCodec(_same, _str)
BYTES_HEX = FieldCodec(bytes.hex, _hex)
JSON_OBJECT = FieldCodec(_same, _object)  # NOTE: a JSON schema, as the client sent it


def optional(inner: FieldCodec) -> FieldCodec:
    """``inner`` or null."""
    return FieldCodec(lambda v: None if v is None else inner.encode(v),
                      lambda v, where: None if v is None else inner.decode(v, where))


def array(inner: FieldCodec) -> FieldCodec:
    """A tuple of ``inner`` as a JSON array."""

    def decode(value: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise _fail(where, "an array", value)
        return tuple(inner.decode(v, f"{where}[{i}]") for i, v in enumerate(value))

    return FieldCodec(lambda v: [inner.encode(x) for x in v], decode)


def pair(first: FieldCodec, second: FieldCodec) -> FieldCodec:
    """A 2-tuple as a JSON array of two."""

    def decode(value: Any, where: str) -> tuple[Any, Any]:
        if not isinstance(value, list) or len(value) != 2:
            raise _fail(where, "an array of two", value)
        return first.decode(value[0], f"{where}[0]"), second.decode(value[1], f"{where}[1]")

    return FieldCodec(lambda v: [first.encode(v[0]), second.encode(v[1])], decode)


def enum(cls: type[Enum]) -> FieldCodec:
    """A member of ``cls`` by its (string) value."""

    def decode(value: Any, where: str) -> Enum:
        try:
            return cls(_str(value, where))
        except ValueError:
            raise StoredRequestError(f"{where}: not a {cls.__name__}: {value!r}") from None

    return FieldCodec(lambda v: v.value, decode)


def record(cls: type[Any], fields: Mapping[str, FieldCodec],
           added: Mapping[str, Any] | None = None) -> FieldCodec:
    """A dataclass ``cls`` as a JSON object with the keys of ``fields`` (its fields:
    ``tests/test_request_codec.py`` checks they are all there); built by ``cls`` itself, so its
    own validation runs. A key of ``added`` may be absent (an older writer's record: the field's
    value is ``added``'s); every other key must be there, and no unknown key may be."""
    absent_means = dict(added or {})

    def decode(value: Any, where: str) -> Any:
        obj = _object(value, where)
        extra, missing = obj.keys() - fields.keys(), fields.keys() - obj.keys() - absent_means.keys()
        if extra or missing:
            raise StoredRequestError(f"{where}: fields differ from {cls.__name__}'s "
                                     f"(unknown {sorted(extra)}, missing {sorted(missing)})")
        args = {name: c.decode(obj[name], f"{where}.{name}") if name in obj
                else absent_means[name] for name, c in fields.items()}
        try:
            return cls(**args)
        except (InvalidRequestError, ValueError, TypeError) as exc:  # NOTE: its own checks
            raise StoredRequestError(f"{where}: {exc}") from None

    return FieldCodec(lambda v: {name: c.encode(getattr(v, name)) for name, c in fields.items()},
                      decode)


def _ids(value: Any, where: str) -> tuple[int, ...]:
    # NOTE: one pass of a type check (bool excluded: it is an int): a prompt may be 100k ids
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise _fail(where, "an array of integers", value)
    return tuple(value)


TOKEN_IDS = FieldCodec(list, _ids)  # NOTE: array(SCALAR_INT), ~20x faster on a long prompt

SAMPLING_FIELDS: dict[str, FieldCodec] = {
    "temperature": SCALAR_FLOAT, "top_p": SCALAR_FLOAT, "top_k": SCALAR_INT,
    "min_p": SCALAR_FLOAT, "repetition_penalty": SCALAR_FLOAT,
    "presence_penalty": SCALAR_FLOAT, "frequency_penalty": SCALAR_FLOAT,
    "logit_bias": array(pair(SCALAR_INT, SCALAR_FLOAT)), "seed": optional(SCALAR_INT),
    "min_tokens": SCALAR_INT, "ignore_eos": SCALAR_BOOL, "logprobs": optional(SCALAR_INT),
}
EARLY_STOP_FIELDS: dict[str, FieldCodec] = {
    "min_tokens": SCALAR_INT, "max_tokens": SCALAR_INT, "deadline_ms": SCALAR_INT,
    "confidence_threshold": SCALAR_FLOAT, "no_retry_after_first_frame": SCALAR_BOOL,
    "require_closure": SCALAR_BOOL,
}
GRAMMAR_FIELDS: dict[str, FieldCodec] = {
    "json_schema": optional(JSON_OBJECT), "json_object": SCALAR_BOOL,
    "regex": optional(SCALAR_STR), "lark": optional(SCALAR_STR),
    "close_within_budget": optional(SCALAR_BOOL), "trigger": optional(SCALAR_STR),
}
BACKPRESSURE_FIELDS: dict[str, FieldCodec] = {
    "policy": enum(BackpressurePolicy), "pause_bytes": SCALAR_INT, "max_bytes": SCALAR_INT,
}
REASONING_FIELDS: dict[str, FieldCodec] = {
    "open": BYTES_HEX, "close": BYTES_HEX, "inside": SCALAR_BOOL, "close_ids": TOKEN_IDS,
    "budget_tokens": optional(SCALAR_INT), "open_ids": TOKEN_IDS,
}
REQUEST_FIELDS: dict[str, FieldCodec] = {
    "prompt_token_ids": TOKEN_IDS,
    "sampling": record(SamplingParams, SAMPLING_FIELDS),
    "max_tokens": optional(SCALAR_INT),
    "stop": array(SCALAR_STR),
    "stop_token_ids": array(TOKEN_IDS),
    "include_stop_str_in_output": SCALAR_BOOL,
    "skip_special_tokens": SCALAR_BOOL,
    "deadline_s": optional(SCALAR_FLOAT),
    "early_stop": optional(record(EarlyStopPolicy, EARLY_STOP_FIELDS)),
    "grammar": optional(record(GrammarSpec, GRAMMAR_FIELDS)),
    "backpressure": optional(record(BackpressureConfig, BACKPRESSURE_FIELDS)),
    "request_id": optional(SCALAR_STR),
    "utf8_tail": SCALAR_STR,
    "stops_end_at": optional(SCALAR_STR),
    "reasoning": optional(record(ReasoningSpec, REASONING_FIELDS)),
    "speculative": SCALAR_BOOL,
    "prompt_logprobs": optional(SCALAR_INT),
    "prediction": optional(TOKEN_IDS),
    "start_at_admission": SCALAR_BOOL,
}
# Fields added to version 1 after it shipped, each with the value a record without it means: what
# the front ends that stored such records did (the module's rolling-upgrade rule, P4).
ADDED_IN_V1: dict[str, Any] = {
    "start_at_admission": False,  # background Responses' in_progress at admission (P1)
}
REQUEST = record(GenerationRequest, REQUEST_FIELDS, ADDED_IN_V1)


def _no_constant(name: str) -> float:
    raise StoredRequestError(f"not JSON: {name}")


def encode_stored(req: GenerationRequest, accepted: float) -> bytes:
    """``req``, accepted at ``accepted`` (unix seconds), as stored in the meta's ``req``.
    Raises ValueError / TypeError for a value JSON cannot carry exactly (NaN, an object no
    client could have sent)."""
    body = {"kind": KIND, "v": VERSION, "accepted": accepted, "req": REQUEST.encode(req)}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def decode_stored(blob: bytes) -> tuple[float, GenerationRequest]:
    """``(accepted, request)`` as :func:`encode_stored` wrote them; :class:`StoredRequestError`
    for anything else (the module's rules)."""
    try:
        body = json.loads(blob, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # NOTE: UnicodeDecodeError is a ValueError
        raise StoredRequestError("not a JSON stored request") from None
    env = _object(body, "stored request")
    if env.get("kind") != KIND or env.keys() != {"kind", "v", "accepted", "req"}:
        raise StoredRequestError(f"not a {KIND} envelope")
    if _int(env["v"], "v") != VERSION:  # NOTE: checked as an integer: True == 1 in Python
        raise StoredRequestError(f"{KIND} version {env['v']}, this front end reads {VERSION}")
    req: GenerationRequest = REQUEST.decode(env["req"], "req")
    return _float(env["accepted"], "accepted"), req
