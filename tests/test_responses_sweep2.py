"""The OpenAI Responses API through the official ``openai`` client, second sweep (SPEC P1), on
a live server over loopback (SmolLM2):

- a ``previous_response_id`` that names no stored response (unknown, ``store: false``,
  deleted) is OpenAI's 400 in OpenAI's words and code, ``previous_response_not_found``
  ("Previous response with id 'resp_…' not found."): clients recover on that code by sending
  the whole history again (it was the generic ``invalid_request``);
- a content part that is not text (an ``input_image``, an ``input_file``; chat's
  ``image_url``) is a 400 whose ``param`` names the part, as its message does
  (``input.0.content.1``; ``param`` said ``input.0.content``).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.openai_sweep_support import bad


def test_p1_an_unknown_previous_response_is_previous_response_not_found(
        oa: openai.OpenAI) -> None:
    """P1: unknown, unstored and deleted alike, on the create and on the input token count."""
    m = oa.models.list().data[0].id
    unstored = oa.responses.create(model=m, input="hi", store=False, max_output_tokens=16)
    deleted = oa.responses.create(model=m, input="hi", max_output_tokens=16)
    oa.responses.delete(deleted.id)
    for rid in ("resp_nope", unstored.id, deleted.id):
        for count in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                if count:
                    oa.responses.input_tokens.count(model=m, input="again",
                                                    previous_response_id=rid)
                else:
                    oa.responses.create(model=m, input="again", max_output_tokens=16,
                                        previous_response_id=rid)
            body = err.value.body
            assert isinstance(body, dict)
            assert body["code"] == "previous_response_not_found"
            assert body["param"] == "previous_response_id"
            assert body["type"] == "invalid_request_error"
            assert body["message"] == f"Previous response with id '{rid}' not found."


def test_p1_a_part_that_is_not_text_is_named_by_its_path(oa: openai.OpenAI) -> None:
    """P1: ``param`` is the part's path, the one the message says."""
    m = oa.models.list().data[0].id
    text = {"type": "input_text", "text": "what is this?"}
    for part in ({"type": "input_image", "image_url": "http://x/y.png", "detail": "auto"},
                 {"type": "input_file", "file_id": "file_1"}):
        given: Any = [{"role": "user", "content": [text, part]}]
        msg = bad(lambda g=given: oa.responses.create(model=m, input=g, max_output_tokens=16),
                  "input.0.content.1")
        assert msg.startswith("input.0.content.1: only text content parts")
    chat: Any = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    bad(lambda: oa.chat.completions.create(model=m, messages=chat), "messages.0.content.1")
