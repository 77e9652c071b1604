"""An OpenAI user's acceptance sweep (SPEC P1, P3) through the official ``openai`` client
over loopback on SmolLM2 and Gemma 3 270M (GGUF; skipped where its file is absent). Found:

- ``stream_options: {"include_usage": true}``: the chunks before the usage chunk carried no
  ``usage`` key; OpenAI's reference says "All other chunks will also include a usage field,
  but with a null value" (chat and legacy completions, ``n`` > 1 too).
- ``max_tokens=3, max_completion_tokens=5`` together generated 5 tokens (one name silently
  won); OpenAI refuses the pair: a 400 naming ``max_tokens`` (``invalid_parameter_combination``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.openai_sweep_support import MODELS, U, serve
from tests.openai_sweep_support import model_of as _model


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


@pytest.mark.parametrize("n", [1, 2])
def test_p1_include_usage_null_on_every_chunk_but_the_last(oa: openai.OpenAI, n: int) -> None:
    """P1, P3: with ``include_usage`` every chunk has a ``usage`` field, null until the last
    one, whose ``choices`` is empty and whose usage counts all choices; each choice ends once."""
    chunks = list(oa.chat.completions.create(
        model=_model(oa), messages=U, n=n, max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert body and all("usage" in c.model_fields_set and c.usage is None for c in body)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 3 * n
    ends = sorted(c.index for ch in body for c in ch.choices if c.finish_reason)
    assert ends == list(range(n))
    legacy = list(oa.completions.create(model=_model(oa), prompt="Hi", max_tokens=2,
                                        stream=True, stream_options={"include_usage": True}))
    assert all("usage" in c.model_fields_set and c.usage is None for c in legacy[:-1])
    assert legacy[-1].choices == [] and legacy[-1].usage is not None


def test_p1_no_usage_field_without_include_usage(oa: openai.OpenAI) -> None:
    """P1: without ``stream_options`` no chunk carries ``usage`` (OpenAI sends none)."""
    chunks = list(oa.chat.completions.create(model=_model(oa), messages=U, max_tokens=2,
                                             stream=True))
    assert chunks and all("usage" not in c.model_fields_set for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_p1_max_tokens_and_max_completion_tokens_together_is_a_400(oa: openai.OpenAI,
                                                                    stream: bool) -> None:
    """P1: both budget names on one chat request: OpenAI's 400 naming ``max_tokens``; either
    one alone (the other null) is served with that budget."""
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=_model(oa), messages=U, max_tokens=3,
                                   max_completion_tokens=5, stream=stream)
    body: Any = exc.value.body
    assert body["param"] == "max_tokens" and body["type"] == "invalid_request_error"
    assert body["code"] == "invalid_parameter_combination"
    for kw in ({"max_tokens": 3, "max_completion_tokens": None},
               {"max_tokens": None, "max_completion_tokens": 3}):
        out = oa.chat.completions.create(model=_model(oa), messages=U, stream=False,
                                         temperature=0, **kw)
        assert out.usage is not None and out.usage.completion_tokens <= 3
