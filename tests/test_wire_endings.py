"""Honest endings on the wire (issue 20 D6, D9 and the ``utf8_tail: auto`` default; SPEC S1,
S3, K2, K3, L4, L6), through the official clients over a scripted default model (see
:mod:`tests.wire_support`): everything but the model's logits is the product.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.wire_support import C3_ID, EOS_ID, X_ID, ScriptedServer, scripted_server

MODEL = "default_model"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def xs() -> Iterator[ScriptedServer]:
    """The model answers ``x`` forever."""
    yield from scripted_server({X_ID: X_ID})


@pytest.mark.parametrize("stop,kept", [({"stop": ["x"]}, 11), ({"stop_token_ids": [X_ID]}, 11),
                                       ({"stop_token_ids": [[X_ID, X_ID]]}, 10)])
def test_issue20_d6_s1_s3_min_tokens_holds_stop_strings_and_ids(xs: ScriptedServer,
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


@pytest.fixture(scope="module")
def lead() -> Iterator[ScriptedServer]:
    """The model answers ``x``, a lone ``0xC3``, EOS (max_tokens 2 cuts the character)."""
    yield from scripted_server()


def test_k3_auto_max_tokens_cut_is_length_not_500_openai(lead: ScriptedServer) -> None:
    """K3 (issue 20 deliverable 2), default ``utf8_tail: auto``: max_tokens ends the answer
    inside a character. The official client gets a normal answer (no InternalServerError):
    ``length`` and text ``x``, streamed and not, with the removed byte in ``coda``; chat,
    legacy completions (Responses, whose least budget is 16: the next test)."""
    client = openai.OpenAI(base_url=lead.url + "/v1", api_key="k", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("length", "x")
    coda = choice.model_extra["coda"]  # type: ignore[index]
    assert coda["state"] == "FINISHED" and coda["finish_reason"] == "max_output_tokens"
    assert coda["utf8_tail_dropped"] == {"bytes": 1, "hex": "c3"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "x"
    assert chunks[-1].choices[0].finish_reason == "length"
    legacy = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert (legacy.choices[0].finish_reason, legacy.choices[0].text) == ("length", "x")



@pytest.fixture(scope="module")
def lead16() -> Iterator[ScriptedServer]:
    """The model answers ``abcdefghijklmno``, a lone ``0xC3``, EOS: Responses' smallest
    budget (16, as OpenAI) cuts the character."""
    letters = list(range(67, 82))  # NOTE: "a" .. "o" in the default model's vocabulary
    chain = {a: b for a, b in zip(letters, [*letters[1:], C3_ID], strict=True)}
    yield from scripted_server({**chain, C3_ID: EOS_ID}, first=letters[0])


def test_k3_auto_max_output_tokens_cut_is_incomplete_not_500_responses(
        lead16: ScriptedServer) -> None:
    """K3, default ``utf8_tail: auto``, Responses: ``max_output_tokens`` (16, OpenAI's
    least) ends the answer inside a character: ``incomplete`` with the text before it."""
    client = openai.OpenAI(base_url=lead16.url + "/v1", api_key="k", max_retries=0)
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert resp.status == "incomplete" and resp.output_text == "abcdefghijklmno"


def test_k3_auto_max_tokens_cut_is_max_tokens_anthropic(lead: ScriptedServer) -> None:
    """K3, deliverable 2: the Anthropic client gets ``stop_reason: max_tokens`` and text ``x``,
    streamed and not, never an error."""
    client = anthropic.Anthropic(base_url=lead.url, api_key="k", max_retries=0)
    m = client.messages.create(model=MODEL, max_tokens=2, messages=MSG)  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and m.content[0].text == "x"  # type: ignore[union-attr]
    with client.messages.stream(model=MODEL, max_tokens=2, messages=MSG) as s:  # type: ignore[arg-type]
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "x" and final.stop_reason == "max_tokens"


def test_k3_auto_eos_inside_a_character_fails_without_retry(lead: ScriptedServer) -> None:
    """K3, L4: ending by EOS inside a character is still FAILED under ``auto``: a 500 with
    ``x-should-retry: false``, which the official client (2 retries) sends exactly once."""
    client = openai.OpenAI(base_url=lead.url + "/v1", api_key="k", max_retries=2)
    before = lead.engine.num_requests_total
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8)
    assert lead.engine.num_requests_total - before == 1
    assert err.value.response.headers["x-should-retry"] == "false"


def test_issue20_d9_l6_anthropic_message_start_carries_the_final_input_usage(xs: ScriptedServer) -> None:
    """Issue 20 D9 (L6): the second identical request hits the prefix cache. Its streamed
    ``message_start`` is sent after the lookup and states the same input usage as
    ``message_delta`` and the non-streamed answer: ``input_tokens`` (not held) +
    ``cache_read_input_tokens`` (held) = the prompt, the cached part > 0."""
    import json

    import httpx

    long = [{"role": "user", "content": "tell me about the quick brown fox " * 6}]
    body = {"model": MODEL, "max_tokens": 3, "messages": long}
    client = anthropic.Anthropic(base_url=xs.url, api_key="k", max_retries=0)
    first = client.messages.create(**body)  # type: ignore[arg-type]
    plain = client.messages.create(**body)  # type: ignore[arg-type]
    assert plain.usage.cache_read_input_tokens  # the prefix cache held part of the prompt
    assert (plain.usage.input_tokens + plain.usage.cache_read_input_tokens
            == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0))
    r = httpx.post(xs.url + "/v1/messages", json={**body, "stream": True}, timeout=30)
    frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    start = frames[0]["message"]["usage"]
    end = next(f for f in frames if f["type"] == "message_delta")["usage"]
    want = {"input_tokens": plain.usage.input_tokens,
            "cache_read_input_tokens": plain.usage.cache_read_input_tokens}
    assert {k: start[k] for k in want} == want == {k: end[k] for k in want}
    with client.messages.stream(**body) as s:  # type: ignore[arg-type]
        for _ in s.text_stream:
            pass
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens == want["cache_read_input_tokens"]
