"""A demanding OpenAI user's sweep of the Responses surface and chat's less-probed fields
(SPEC P1, P3), through the official ``openai`` client over loopback on SmolLM2 and Gemma 3
270M (GGUF; skipped where its file is absent), every answer parsed into the SDK's own
pydantic types with ``model_validate`` (the SDK itself builds its objects without
validation, so a missing required field only shows there). Found:

- Responses ``usage.input_tokens_details`` lacked ``cache_write_tokens``, which the SDK's
  ``InputTokensDetails`` requires: ``Response.model_validate`` of any created, retrieved or
  streamed terminal response failed, and ``usage.input_tokens_details.cache_write_tokens``
  read ``None`` where the type says ``int``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.openai_sweep_support import MODELS, serve
from tests.openai_sweep_support import model_of as _model

EVENT: Any = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


def _events(oa: openai.OpenAI, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw ``data:`` objects of a streamed create, as the server wrote them."""
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{oa.base_url}responses", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


def test_p1_responses_validate_as_the_sdks_types(oa: openai.OpenAI) -> None:
    """P1, P3: a created, a retrieved and a streamed response (every event) validate as the
    SDK's ``Response`` / ``ResponseStreamEvent``; the usage's token counts agree."""
    body = {"model": _model(oa), "input": "Say hi", "max_output_tokens": 16}
    raw = oa.responses.with_raw_response.create(**body)
    made = Response.model_validate(json.loads(raw.text))
    assert made.usage is not None
    details = made.usage.input_tokens_details
    assert details.cache_write_tokens == 0 and details.cached_tokens >= 0
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    got = oa.responses.with_raw_response.retrieve(made.id)
    assert Response.model_validate(json.loads(got.text)).usage == made.usage
    events = _events(oa, body)
    for e in events:
        EVENT.validate_python(e)
    final = Response.model_validate(events[-1]["response"])
    assert final.usage is not None and final.usage.input_tokens_details.cache_write_tokens == 0
    assert final.usage.output_tokens <= 16
