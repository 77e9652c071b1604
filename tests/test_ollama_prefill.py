"""Ollama ``/api/chat`` with a final assistant message continues it (SPEC P1), as Ollama's
templates leave that last turn open: the answer is only what follows the prefill. Coda closed
the turn and started a new one, so the model answered afresh (often repeating the prefill).
Checked on the real SmolLM2 model through the official ``ollama`` client, against Anthropic's
prefill on the same server (one prompt, one greedy answer). Also: the /api/generate fields
Coda refuses say what to send instead."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import ollama
import pytest

ASK = {"role": "user", "content": "Count from 1 to 10, separated by commas."}
PREFILL = {"role": "assistant", "content": "1, 2, 3,"}


def _prompt_tokens(url: str, name: str, messages: list[dict[str, str]]) -> int:
    """The prompt's token count (``coda.usage``: the cache hits included) of a short chat."""
    body = {"model": name, "messages": messages, "stream": False,
            "options": {"temperature": 0, "num_predict": 2}}
    r = httpx.post(url + "/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["coda"]["usage"]["prompt_tokens"])


def test_p1_chat_continues_a_final_assistant_message(smollm_ollama: ollama.Client,
                                                     smollm_name: str,
                                                     smollm_live: Any) -> None:
    """P1: the prompt ends in the prefill (no end of turn, no new assistant header): its
    tokens are Anthropic's prefill prompt's, and the greedy answer is the same continuation,
    streamed or not."""
    opts = {"temperature": 0, "num_predict": 8}
    whole = smollm_ollama.chat(model=smollm_name, messages=[ASK, PREFILL], options=opts)
    claude = anthropic.Anthropic(base_url=smollm_live.url, api_key="x", max_retries=0)
    ref = claude.messages.create(model=smollm_name, max_tokens=8, extra_body={"temperature": 0},
                                 messages=[ASK, PREFILL])
    ref_prompt = ref.usage.input_tokens + (ref.usage.cache_read_input_tokens or 0)
    assert _prompt_tokens(smollm_live.url, smollm_name, [ASK, PREFILL]) == ref_prompt
    assert whole.message.content == ref.content[0].text  # type: ignore[union-attr]
    parts = list(smollm_ollama.chat(model=smollm_name, messages=[ASK, PREFILL],
                                    options=opts, stream=True))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content


def test_p1_final_user_message_still_opens_a_new_turn(smollm_name: str,
                                                      smollm_live: Any) -> None:
    """P1: a history whose last message is the user's is not a prefill: the prompt is the
    one that ends with the template's assistant header (more tokens than the closed
    assistant turn's text alone would give)."""
    closed = _prompt_tokens(smollm_live.url, smollm_name,
                            [ASK, PREFILL, {"role": "user", "content": "Go on"}])
    assert closed > _prompt_tokens(smollm_live.url, smollm_name, [ASK, PREFILL])


@pytest.mark.parametrize(("field", "value", "says"), [
    ("template", "{{ .Prompt }}", "raw: true"),
    ("suffix", "end", "fill-in-the-middle"), ("images", ["aGk="], "vision")])
def test_p1_refused_generate_fields_say_what_to_send_instead(
        smollm_ollama: ollama.Client, smollm_name: str, field: str, value: Any,
        says: str) -> None:
    """P1: ``template``, ``suffix`` and ``images`` on /api/generate are a 400 naming the field
    and what to send instead (it said only "<field>: not supported"); ``context`` is taken
    (tests/test_ollama_context.py)."""
    with pytest.raises(ollama.ResponseError) as err:
        smollm_ollama.generate(model=smollm_name, prompt="hi", options={"num_predict": 1},
                               **{field: value})
    assert err.value.status_code == 400
    assert err.value.error.startswith(f"{field}: not supported: ") and says in err.value.error
