"""Legacy ``/v1/completions`` answers what OpenAI and vLLM answer for the same request (SPEC
P1, L4), through the official ``openai`` client over loopback on SmolLM2 (byte-level BPE) and
Gemma 3 270M (SentencePiece; skipped where its GGUF is absent). Found by the acceptance sweep
of the surfaces outside chat:

- An omitted ``max_tokens`` ran to the engine's ``default_max_tokens`` (256 by default);
  OpenAI's API reference says completions' ``max_tokens`` "Defaults to 16", and vLLM's
  ``CompletionRequest`` has the same default. Now 16, per prompt, where the context has room
  for it; where it has not, the output runs to the context (``context_limit``), never a 400
  about a limit the client did not send.
- ``logprobs: k`` with sampling listed the k best tokens only, so a sampled token outside
  them had no ``top_logprobs`` entry; OpenAI's reference: "The API will always return the
  logprob of the sampled token, so there may be up to logprobs+1 elements" (vLLM likewise).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.openai_sweep_support import MODELS, serve

CONTEXT = 256
ENGINE_DEFAULT = 40  # NOTE: the engine's own default, distinct from the route's 16


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param, context=CONTEXT, default_max_tokens=ENGINE_DEFAULT, seqs=4,
                     kv_mib=64)


def _model(oa: openai.OpenAI) -> str:
    return oa.models.list().data[0].id


NO_EOS: Any = {"ignore_eos": True}  # NOTE: only a budget can end the output


def test_p1_l4_omitted_max_tokens_is_sixteen(oa: openai.OpenAI) -> None:
    """P1, L4: without ``max_tokens`` a completion has 16 tokens (OpenAI's and vLLM's
    default), streamed or not; chat keeps the engine's default."""
    m = _model(oa)
    r = oa.completions.create(model=m, prompt="Once upon a time", extra_body=NO_EOS)
    assert r.usage is not None and r.usage.completion_tokens == 16, r.usage
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].model_extra["coda"]["finish_reason"] == "max_output_tokens"
    chunks = list(oa.completions.create(model=m, prompt="Once upon a time", stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body=NO_EOS))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    chat = oa.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}],
                                      extra_body=NO_EOS)
    assert chat.usage is not None and chat.usage.completion_tokens == ENGINE_DEFAULT


def test_l4_omitted_max_tokens_is_per_prompt_and_bounded_by_the_context(
        oa: openai.OpenAI) -> None:
    """L4: in a batch each prompt gets 16 where the context has room for them; a prompt that
    leaves fewer runs to the context (finish ``length``, ``coda`` ``context_limit``) instead of
    a 400; an explicit ``max_tokens`` past the room is still the 400 naming it."""
    m = _model(oa)
    short = [2, 3, 4]
    long = [5] * (CONTEXT - 6)  # NOTE: 6 tokens of room, fewer than 16
    r = oa.completions.create(model=m, prompt=[short, long], extra_body=NO_EOS)
    first, second = sorted(r.choices, key=lambda c: c.index)
    assert first.finish_reason == second.finish_reason == "length"
    assert first.model_extra["coda"]["usage"]["selected_tokens"] == 16
    assert second.model_extra["coda"]["finish_reason"] == "context_limit"
    assert second.model_extra["coda"]["usage"]["selected_tokens"] == 6
    with pytest.raises(openai.BadRequestError) as exc:
        oa.completions.create(model=m, prompt=long, max_tokens=16)
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_p1_legacy_top_logprobs_always_hold_the_sampled_token(oa: openai.OpenAI,
                                                             k: int) -> None:
    """P1, O1: every ``top_logprobs`` entry holds the sampled token with its own logprob, the
    k best first, so at most k + 1 entries (``logprobs: 0``: the token alone), streamed and
    not; a hot sample makes tokens outside the k best certain."""
    m = _model(oa)
    kw: Any = dict(model=m, prompt="Once upon a time", max_tokens=24, logprobs=k,
                   temperature=1.8, seed=11, extra_body=NO_EOS)
    whole = oa.completions.create(**kw).choices[0].logprobs
    chunks = list(oa.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs
                for e in zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                             c.logprobs.top_logprobs, strict=True)]
    assert whole is not None
    entries = list(zip(whole.tokens, whole.token_logprobs, whole.top_logprobs, strict=True))
    assert entries == streamed and len(entries) == 24
    outside = 0
    for token, logprob, top in entries:
        assert top[token] == logprob and len(top) <= k + 1, (token, top)
        best = list(top.values())[:k]
        assert best == sorted(best, reverse=True)
        outside += len(top) == k + 1
    assert outside > 0 if k else outside == 24
