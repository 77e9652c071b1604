"""The Responses object echoes ``previous_response_id`` and every create answer carries
``x-request-id`` (SPEC P1), through the official ``openai`` client over loopback: found by the
acceptance sweep (the SDK read ``previous_response_id`` as None, ``_request_id`` as None)."""

from __future__ import annotations

import openai

from tests.test_server_openai import MODEL


def test_p1_previous_response_id_is_echoed_on_create_stream_and_retrieve(
        oa: openai.OpenAI) -> None:
    """P1: a continuation's response object names the response it continued, on create,
    in the stream's ``response.created`` and ``response.completed``/``incomplete``, and on
    retrieve; a first turn's is null."""
    first = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert first.previous_response_id is None
    two = oa.responses.create(model=MODEL, input="again", max_output_tokens=16,
                              previous_response_id=first.id)
    assert two.previous_response_id == first.id
    assert oa.responses.retrieve(two.id).previous_response_id == first.id
    events = list(oa.responses.create(model=MODEL, input="more", max_output_tokens=16,
                                      previous_response_id=two.id, stream=True))
    assert events[0].response.previous_response_id == two.id  # type: ignore[union-attr]
    assert events[-1].response.previous_response_id == two.id  # type: ignore[union-attr]

def test_p1_create_answers_carry_x_request_id(oa: openai.OpenAI) -> None:
    """P1: ``x-request-id`` is the response id on a plain, a streamed and a background
    create (the SDK's ``_request_id``)."""
    plain = oa.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=16)
    assert plain.headers.get("x-request-id") == plain.parse().id
    assert plain.parse()._request_id == plain.parse().id
    bg = oa.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=16,
                                               background=True)
    assert bg.headers.get("x-request-id") == bg.parse().id
    with oa.responses.with_streaming_response.create(model=MODEL, input="hi",
                                                     max_output_tokens=16, stream=True) as s:
        rid = s.headers.get("x-request-id")
        body = s.read().decode()
    assert rid is not None and rid.startswith("resp_") and rid in body
