"""Honest endings on the wire (issue 20 D6, D9 and the ``utf8_tail: auto`` default; SPEC S1,
S3, K2, K3, L4, L6), through the official clients over a scripted default model (see
:mod:`tests.wire_support`): everything but the model's logits is the product.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.wire_support import X_ID, ScriptedServer, scripted_server

MODEL = "default_model"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def xs() -> Iterator[ScriptedServer]:
    """The model answers ``x`` forever."""
    yield from scripted_server({X_ID: X_ID})


@pytest.mark.parametrize("stop,kept", [({"stop": ["x"]}, 11), ({"stop_token_ids": [X_ID]}, 11),
                                       ({"stop_token_ids": [[X_ID, X_ID]]}, 10)])
def test_d6_s1_s3_min_tokens_holds_stop_strings_and_ids(xs: ScriptedServer,
                                                        stop: dict[str, object],
                                                        kept: int) -> None:
    """Issue 20 D6 (S1, S3): with ``min_tokens: 12`` a stop string or stop id that completes
    at tokens 1..11 is ordinary text; the first one completing at token 12 or later ends the
    request (as vLLM does): 12 tokens are selected and the text is what precedes the stop."""
    client = openai.OpenAI(base_url=xs.url + "/v1", api_key="k", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40,
                                       extra_body={"min_tokens": 12, **stop})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "x" * kept
    assert r.usage is not None and r.usage.completion_tokens == 12
    plain = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40,
                                           extra_body=stop)
    assert plain.choices[0].message.content == ""  # without min_tokens: at token 1 or 2
    assert plain.usage is not None and plain.usage.completion_tokens <= 2
