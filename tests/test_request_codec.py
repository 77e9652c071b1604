"""The stored request an adopter runs from is typed, versioned JSON, never a pickle (SPEC P4,
L5; :mod:`coda.durable.request_codec`, docs/scale-out.md "Trust boundary").

Every field of :class:`~coda.engine.types.GenerationRequest` and of the dataclasses it holds
round-trips exactly; a field added to one of them without a codec entry fails here (the codec
tables and the strategies are both checked against ``dataclasses.fields``). A payload that is
not this codec's (the old pickle, a malicious one, another version, a wrong type, a value the
dataclass refuses) raises :class:`~coda.durable.request_codec.StoredRequestError`, and nothing
of it runs."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.durable.request_codec import (
    ADDED_IN_V1,
    BACKPRESSURE_FIELDS,
    EARLY_STOP_FIELDS,
    GRAMMAR_FIELDS,
    REASONING_FIELDS,
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    StoredRequestError,
    decode_stored,
    encode_stored,
)
from coda.early_stop import EarlyStopPolicy
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.reasoning import ReasoningSpec
from coda.sampling import SamplingParams
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy

TABLES: list[tuple[type[Any], dict[str, Any]]] = [
    (GenerationRequest, REQUEST_FIELDS), (SamplingParams, SAMPLING_FIELDS),
    (EarlyStopPolicy, EARLY_STOP_FIELDS), (GrammarSpec, GRAMMAR_FIELDS),
    (BackpressureConfig, BACKPRESSURE_FIELDS), (ReasoningSpec, REASONING_FIELDS)]


def test_the_codec_has_an_entry_for_every_field_of_each_stored_dataclass_p4() -> None:
    """A field added to a stored dataclass without its codec entry would be dropped (or
    refused) on adoption: the tables must name exactly the dataclasses' fields."""
    for cls, table in TABLES:
        assert list(table) == [f.name for f in fields(cls)], cls.__name__


def _every_field(cls: type[Any], draws: dict[str, st.SearchStrategy[Any]]
                 ) -> st.SearchStrategy[Any]:
    """``cls`` built with a drawn value for each of its fields (a field this test does not
    draw fails it: add it to the codec and here)."""
    missing = [f.name for f in fields(cls) if f.name not in draws]
    assert not missing, f"{cls.__name__} fields the round trip does not draw: {missing}"
    return st.builds(cls, **{f.name: draws[f.name] for f in fields(cls)})


IDS = st.lists(st.integers(0, 2**31 - 1), max_size=12).map(tuple)
TEXT = st.text(max_size=12)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | FINITE | TEXT,
                          lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)


def _requests() -> st.SearchStrategy[GenerationRequest]:
    sampling = _every_field(SamplingParams, {
        "temperature": st.floats(0, 100), "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(-1, 1000), "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(1e-3, 10), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(st.integers(0, 10**6), st.floats(-100, 100), max_size=3),
        "seed": st.none() | st.integers(), "min_tokens": st.integers(0, 10**6),
        "ignore_eos": st.booleans(), "logprobs": st.none() | st.integers(0, 20)})
    early_stop = _every_field(EarlyStopPolicy, {
        "min_tokens": st.integers(0, 10), "max_tokens": st.integers(10, 10**6),
        "deadline_ms": st.integers(1, 10**9), "confidence_threshold": st.floats(0, 1),
        "no_retry_after_first_frame": st.booleans(), "require_closure": st.booleans()})
    grammar = _every_field(GrammarSpec, {
        "json_schema": st.none() | st.dictionaries(TEXT, JSON_VALUE, max_size=3),
        "json_object": st.booleans(), "regex": st.none() | TEXT, "lark": st.none() | TEXT,
        "close_within_budget": st.none() | st.booleans(), "trigger": st.none() | TEXT})
    backpressure = _every_field(BackpressureConfig, {
        "policy": st.sampled_from(BackpressurePolicy), "pause_bytes": st.integers(1, 1000),
        "max_bytes": st.integers(1000, 10**9)})
    reasoning = _every_field(ReasoningSpec, {
        "open": st.binary(max_size=8), "close": st.binary(max_size=8), "inside": st.booleans(),
        "close_ids": IDS, "budget_tokens": st.none() | st.integers(0, 10**6), "open_ids": IDS})
    return _every_field(GenerationRequest, {
        "prompt_token_ids": IDS, "sampling": sampling,
        "max_tokens": st.none() | st.integers(-1, 10**6),
        "stop": st.lists(TEXT, max_size=3).map(tuple),
        "stop_token_ids": st.lists(IDS, max_size=3).map(tuple),
        "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
        "deadline_s": st.none() | st.floats(1e-3, 1e6), "early_stop": st.none() | early_stop,
        "grammar": st.none() | grammar, "backpressure": st.none() | backpressure,
        "request_id": st.none() | TEXT, "utf8_tail": st.sampled_from(["auto", "fail", "drop"]),
        "stops_end_at": st.none() | TEXT, "reasoning": st.none() | reasoning,
        "speculative": st.booleans(), "prompt_logprobs": st.none() | st.integers(0, 20),
        "prediction": st.none() | IDS, "start_at_admission": st.booleans()})


@given(st.data(), st.floats(0, 4e9))
def test_every_field_of_a_stored_request_round_trips_exactly_p4(data: st.DataObject,
                                                                accepted: float) -> None:
    """P4: the adopter runs exactly what the dead ingress was asked (every field, nested
    dataclasses included), and when it was accepted (its deadline is cut by the time since)."""
    req = data.draw(_requests())
    blob = encode_stored(req, accepted)
    assert decode_stored(blob) == (accepted, req)
    assert json.loads(blob)["v"] == 1  # NOTE: plain JSON, versioned


@given(st.data())
def test_a_record_stored_before_a_field_was_added_reads_as_its_writer_ran_it_p4(
        data: st.DataObject) -> None:
    """P4 across a rolling upgrade: a request stored by a front end that predates a field of
    ``ADDED_IN_V1`` (its record lacks the key) is adopted as that front end ran it: the
    field's listed value, every other field exactly as stored."""
    assert ADDED_IN_V1 == {"start_at_admission": False}  # NOTE: a new entry: draw it below
    req = data.draw(_requests())
    body = json.loads(encode_stored(req, 1.5e9))
    left_out = data.draw(st.sets(st.sampled_from(sorted(ADDED_IN_V1)), min_size=1))
    for name in left_out:
        del body["req"][name]
    expected = replace(req, **{name: ADDED_IN_V1[name] for name in left_out})
    assert decode_stored(json.dumps(body).encode()) == (1.5e9, expected)


def _valid() -> dict[str, Any]:
    req = GenerationRequest((1, 2, 3), SamplingParams(temperature=0.5, seed=7), max_tokens=4,
                            backpressure=BackpressureConfig(), reasoning=ReasoningSpec())
    out: dict[str, Any] = json.loads(encode_stored(req, 1.5e9))
    return out


def _edited(path: str, value: Any) -> bytes:
    body = _valid()
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return json.dumps(body).encode()


class _Payload:
    """A pickle that runs code when loaded (makes directory ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


REFUSED = {
    "old pickle": pickle.dumps((1.5e9, GenerationRequest((1, 2, 3)))),
    "another version": _edited("v", 2),
    "version as a bool": _edited("v", True),
    "no kind": _edited("kind", KeyError),
    "another kind": _edited("kind", "coda.event"),
    "extra envelope key": _edited("py/object", "os.system"),
    "prompt ids as strings": _edited("req.prompt_token_ids", ["1", "2"]),
    "prompt id as a bool": _edited("req.prompt_token_ids", [True]),
    "prompt ids as a string": _edited("req.prompt_token_ids", "123"),
    "max_tokens as a float": _edited("req.max_tokens", 4.0),
    "temperature as a string": _edited("req.sampling.temperature", "hot"),
    "temperature out of range": _edited("req.sampling.temperature", -1.0),
    "unknown sampling field": _edited("req.sampling.__reduce__", 1),
    "missing field": _edited("req.stop", KeyError),
    "a newer writer's field": _edited("req.start_after_draft", True),
    "an added field's key, wrong type": _edited("req.start_at_admission", 0),
    "unknown policy": _edited("req.backpressure.policy", "drop-all"),
    "backpressure bounds refused": _edited("req.backpressure.pause_bytes", 0),
    "marker not hex": _edited("req.reasoning.open", "<think>"),
    "stop token ids flat": _edited("req.stop_token_ids", [1, 2]),
    "NaN deadline": _edited("req.deadline_s", 0.125).replace(b"0.125", b"NaN"),
    "deadline infinite by overflow": _edited("req.deadline_s", 0.125).replace(b"0.125", b"1e999"),
    "a stop string as a number": _edited("req.stop", [7]),
    "request id as a number": _edited("req.request_id", 7),
    "infinite accepted": _edited("accepted", 1.5).replace(b"1.5", b"Infinity"),
    "not JSON": b"\x80\x04not json",
    "not UTF-8": b'{"kind": "\xff"}',
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "an array": b"[1, 2]",
}


@pytest.mark.parametrize("blob", list(REFUSED.values()), ids=list(REFUSED))
def test_a_payload_that_is_not_this_codecs_is_refused_l5(blob: bytes) -> None:
    """L5 (an unreadable stored request is a transport failure, never a model's): refused with
    :class:`StoredRequestError`, nothing else raised."""
    with pytest.raises(StoredRequestError):
        decode_stored(blob)


def test_an_acceptance_time_json_cannot_carry_exactly_is_refused_at_encode_p4() -> None:
    """P4: what is stored is plain JSON: a NaN or infinite time is a ValueError at encode, not a
    ``NaN`` token another front end's JSON reader refuses."""
    for t in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            encode_stored(GenerationRequest((1, 2, 3)), t)


def test_a_malicious_pickle_is_refused_without_running_p4(tmp_path: Path) -> None:
    """P4 (the adopter's trust boundary): a pickle planted as a stored request runs nothing
    (``pickle.loads`` ran it: the marker directory appeared)."""
    marker = tmp_path / "ran"
    with pytest.raises(StoredRequestError):
        decode_stored(pickle.dumps(_Payload(marker)))
    assert not marker.exists()
