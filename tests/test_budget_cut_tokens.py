"""A partial last character the budget cut is removed from the text (K3), and from the token
entries too (K2): the logprob entries' bytes reassemble the text exactly at a budget end, as
at a stop (tests/test_stop_cut_tokens.py). Found on SmolLM2: chat ``logprobs`` at
``max_tokens`` 20 ended in the bytes ``e2 80`` (the start of a ZWJ) that ``content`` did not
have; on Gemma 3 likewise with its byte-fallback tokens. Every selected token stays reported (each is billed), the cut ones with only the bytes
the text has."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.finish import FinishReason
from coda.output import OutputProcessor
from coda.output_delta import cut_tail
from coda.stream import EventType, RequestStream, TokenInfo, shown_bytes
from coda.trace import NullTraceSink
from tests.openai_sweep_support import serve
from tests.scripted import output_spec, scripted_tokenizer

E = "é".encode()
TABLE = {101: b"AB", 102: b"C" + E[:1], 103: E[1:] + b"D", 104: E[:1]}
TOK = scripted_tokenizer(TABLE)


def _run(script: list[int]) -> tuple[str, list[TokenInfo], bytes]:
    stream = RequestStream("r")
    proc = OutputProcessor("r", TOK, output_spec(max_tokens=len(script)), stream,
                           NullTraceSink())
    reason = None
    for i in script:
        reason = proc.on_token(i, TokenInfo(i, -0.1, piece=TABLE[i]))
    assert reason is FinishReason.MAX_OUTPUT_TOKENS
    assert proc.drain(reason) is FinishReason.MAX_OUTPUT_TOKENS
    deltas = [e for e in stream.events_after(-1) if e.type is EventType.DELTA]
    tokens = [t for e in deltas for t in e.tokens] + list(proc.trailing_tokens())
    return "".join(e.text for e in deltas), tokens, proc.dropped_tail


@pytest.mark.parametrize(("script", "text", "pieces"), [
    ([101, 102], "ABC", [b"AB", b"C"]),        # the token the cut ends inside keeps "C"
    ([101, 104], "AB", [b"AB", b""]),          # a token wholly in the cut keeps none
    ([101, 102, 103, 104], "ABCéD", [b"AB", b"C\xc3", b"\xa9D", b""]),
])
def test_k2_k3_budget_cut_tokens_keep_only_the_texts_bytes(
        script: list[int], text: str, pieces: list[bytes]) -> None:
    """K2, K3: at max_tokens inside a character the text loses the partial character, and the
    token entries lose the same bytes: their pieces joined are the text; every token stays."""
    got_text, tokens, dropped = _run(script)
    assert (got_text, dropped) == (text, E[:1])
    assert [t.token_id for t in tokens] == script
    assert [t.piece for t in tokens] == pieces


@settings(deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=4), st.booleans()), max_size=10),
       st.booleans(), st.integers(min_value=0, max_value=50))
def test_k2_cut_tail_removes_exactly_the_last_n_shown_bytes(
        tokens: list[tuple[bytes, bool]], skip: bool, n: int) -> None:
    """K2: for all tokens and counts, every token stays (same ids, same order) and the shown
    bytes lose exactly their last ``n`` (all of them when fewer)."""
    infos = [TokenInfo(i, None, piece=p, special=s) for i, (p, s) in enumerate(tokens)]
    shown = b"".join(p for p, s in tokens if not (skip and s))
    out = cut_tail(infos, n, skip)
    assert [t.token_id for t in out] == list(range(len(tokens)))
    assert b"".join(t.piece[:shown_bytes(t, skip)] for t in out) == shown[:max(len(shown) - n, 0)]


# (model, a prompt its tokenizer answers with characters split across tokens, budgets some of
# which end inside one): SmolLM2's byte-level BPE, Gemma 3's SentencePiece byte fallback
CASES = {"smollm2": ("Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉 😊 😇 🥰 😍", range(2, 8)),
         "gemma3": ("Fraktur: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫𝔦", range(3, 7))}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, openai.OpenAI]]:
    for client in serve(request.param):
        yield request.param, client


def test_k2_chat_logprob_bytes_are_the_content_at_a_budget_cut(
        served: tuple[str, openai.OpenAI]) -> None:
    """K2, K3 on SmolLM2 and Gemma 3 (where its file is here): for budgets that end inside a
    character (``coda.utf8_tail_dropped``), the ``logprobs.content`` bytes, non-streamed and
    streamed, are the content's bytes exactly, one entry per completion token."""
    which, oa = served
    prompt, budgets = CASES[which]
    body: dict[str, Any] = {"model": oa.models.list().data[0].id, "temperature": 0,
                            "logprobs": True, "messages": [{"role": "user", "content": prompt}]}
    url = f"{oa.base_url}chat/completions"
    cut = 0
    for budget in budgets:
        r = httpx.post(url, json={**body, "max_tokens": budget}, timeout=120).json()
        choice = r["choices"][0]
        got = bytes(b for e in choice["logprobs"]["content"] for b in e["bytes"])
        assert got == choice["message"]["content"].encode(), budget
        assert len(choice["logprobs"]["content"]) == r["usage"]["completion_tokens"]
        if "utf8_tail_dropped" not in choice["coda"]:
            continue
        cut += 1
        streamed = oa.chat.completions.create(**body, max_tokens=budget, stream=True)
        text, raw = "", b""
        for chunk in streamed:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                lp = chunk.choices[0].logprobs
                raw += b"".join(bytes(e.bytes or []) for e in (lp.content or [])) if lp else b""
        assert (text, raw) == (choice["message"]["content"], got), budget
    assert cut, "no budget in the range ended inside a character"
