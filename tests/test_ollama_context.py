"""Ollama ``/api/generate``'s ``context`` (SPEC P1, P3): the done object carries the token ids
of the prompt and the output, and a request's ``context`` goes before the new prompt's ids,
so sending it back continues the conversation exactly. Before, the done object had no
``context`` and a request carrying one was a 400. Checked on the real SmolLM2 model through
the official ``ollama`` client: the continuation's greedy answer is the one the concatenated
token ids give on ``/v1/completions``; a bad context is a 400 in Ollama's error shape."""

from __future__ import annotations

from typing import Any

import httpx
import ollama
import openai
import pytest

GREEDY = {"temperature": 0, "num_predict": 12}


def _usage(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    r = httpx.post(url + "/api/generate", json={**body, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json(), r.json()["coda"]["usage"]


def test_p1_p3_two_step_generate_continues_with_context(
        smollm_ollama: ollama.Client, smollm_name: str, smollm_live: Any) -> None:
    """P1, P3: ``context`` is the prompt's ids then every output id; sent back, it is the
    start of the next prompt (its prompt count includes it, the cache hits counted), and the
    greedy answer is the concatenated ids' answer; the streamed done line says the same."""
    first = smollm_ollama.generate(model=smollm_name, prompt="My name is Ada. Say hi.",
                                   options=GREEDY)
    assert first.context and first.eval_count
    body, usage = _usage(smollm_live.url, {"model": smollm_name, "options": GREEDY,
                                           "prompt": "My name is Ada. Say hi."})
    assert body["context"] == first.context
    assert len(first.context) == usage["prompt_tokens"] + usage["selected_tokens"]
    second = smollm_ollama.generate(model=smollm_name, prompt="What is my name?",
                                    context=first.context, options=GREEDY)
    assert second.context is not None and second.eval_count is not None
    assert second.context[:len(first.context)] == first.context
    body, usage = _usage(smollm_live.url, {"model": smollm_name, "options": GREEDY,
                                           "prompt": "What is my name?",
                                           "context": first.context})
    prompt_len = len(second.context) - second.eval_count
    assert usage["prompt_tokens"] == prompt_len > len(first.context)
    assert body["prompt_eval_count"] + usage["cached_prompt_tokens"] == prompt_len
    oa = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="k", max_retries=0)
    direct = oa.completions.create(model=smollm_name, prompt=second.context[:prompt_len],
                                   max_tokens=12, temperature=0)
    assert direct.choices[0].text == second.response
    lines = list(smollm_ollama.generate(model=smollm_name, prompt="What is my name?",
                                        context=first.context, options=GREEDY, stream=True))
    assert lines[-1].done and lines[-1].context == second.context
    assert all(line.context is None for line in lines[:-1])


def test_p1_raw_generate_after_a_context_adds_no_second_bos(
        smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """P1: a raw prompt after a context is its own ids appended (no BOS the tokenizer adds)."""
    alone = smollm_ollama.generate(model=smollm_name, prompt=" and then", raw=True,
                                   options=GREEDY)
    first = smollm_ollama.generate(model=smollm_name, prompt="Once upon a time", raw=True,
                                   options=GREEDY)
    assert alone.context and first.context and alone.eval_count
    own = alone.context[:len(alone.context) - alone.eval_count]
    then = smollm_ollama.generate(model=smollm_name, prompt=" and then", raw=True,
                                  context=first.context, options=GREEDY)
    assert then.context and then.eval_count
    assert then.context[:len(then.context) - then.eval_count] == [*first.context, *own]


@pytest.mark.parametrize(("context", "says"), [
    ("1 2 3", "context: Input should be a valid list"),
    ({"ids": [1]}, "context: Input should be a valid list"),
    ([1, "2"], "context.1: Input should be a valid integer"),
    ([1, True], "context.1: Input should be a valid integer"),
    ([1.5], "context.0: Input should be a valid integer"),
    ([-1], "context: token id -1 is not in this model's vocabulary"),
    ([7, 10**6], "context: token id 1000000 is not in this model's vocabulary")])
def test_p1_a_bad_context_is_a_400_in_ollamas_shape(smollm_name: str, smollm_live: Any,
                                                    context: Any, says: str) -> None:
    """P1: a context that is not a list of the model's token ids is a 400 ``{"error"}``."""
    r = httpx.post(smollm_live.url + "/api/generate", timeout=60, json={
        "model": smollm_name, "prompt": "hi", "context": context, "stream": False})
    assert r.status_code == 400, r.text
    assert list(r.json()) == ["error"] and r.json()["error"].startswith(says), r.text


def test_p1_a_context_past_the_window_is_the_long_prompts_400(
        smollm_ollama: ollama.Client, smollm_name: str, smollm_engine: Any) -> None:
    """P1: a context longer than the model's context is refused as an over-long prompt is."""
    n = smollm_engine.context_length
    with pytest.raises(ollama.ResponseError) as err:
        smollm_ollama.generate(model=smollm_name, prompt="hi", context=[42] * n, raw=True)
    assert err.value.status_code == 400
    assert err.value.error == f"the prompt has {n + 1} tokens; this model's context is {n} tokens"
    with pytest.raises(ollama.ResponseError) as long:
        smollm_ollama.generate(model=smollm_name, prompt=" hi" * (n + 1), raw=True)
    assert long.value.status_code == 400
    assert long.value.error.startswith("the prompt has ") and long.value.error.endswith(
        f"; this model's context is {n} tokens")


def test_p1_a_templated_prompt_after_a_context_repeats_no_bos() -> None:
    """P1: Gemma's template writes ``<bos>``; after a context (which opened the sequence with
    it) the next templated prompt goes on without a second one mid-sequence."""
    from tests.openai_sweep_support import GEMMA

    if not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from tests.conftest import LiveServer

    engine = AsyncEngine.from_model_dir(str(GEMMA), EngineConfig(
        max_num_seqs=2, kv_cache_bytes=64 * 2**20, max_model_len=512))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        bos = engine.tokenizer.token_to_id(engine.chat.bos_token)
        body = {"model": str(engine.model_name), "options": {"temperature": 0, "num_predict": 4}}
        first, _ = _usage(live.url, {**body, "prompt": "Say hi."})
        assert first["context"][0] == bos
        second, _ = _usage(live.url, {**body, "prompt": "Again.", "context": first["context"]})
        assert second["context"][:len(first["context"])] == first["context"]
        assert second["context"].count(bos) == 1
    finally:
        live.stop()
        engine.shutdown()
