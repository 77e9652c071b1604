"""Ollama's ``options`` read as Ollama reads them (docs/api.md "Ollama API";
coda/server/ollama_options.py; SPEC P1, L4, L6), through the official ``ollama`` client on
the real SmolLM2 server over loopback.

Each test failed before its fix: ``num_predict`` unset ended at the engine's
``default_max_tokens`` (48 in this fixture; 256 served) with ``done_reason: "length"`` where
Ollama's default (-1) runs to EOS; a negative ``num_predict`` other than -1/-2, a
``temperature`` above OpenAI's 2 or below 0, a negative ``top_k`` and a ``top_p`` / ``min_p``
outside [0, 1] were 400s where Ollama reads each as a sampler setting; ``seed: -1`` (Ollama's
"no seed") was the fixed seed -1; ``/api/ps`` had no ``expires_at``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import ollama
import pytest

FRUITS = [{"role": "user", "content": "List five fruits and say one sentence about each."}]
DEFAULT_MAX_TOKENS = 48  # NOTE: the smollm_engine fixture's EngineConfig.default_max_tokens


def _chat(client: ollama.Client, model: str, options: dict[str, Any],
          messages: list[dict[str, str]] = FRUITS) -> Any:
    return client.chat(model=model, messages=messages, options=options, stream=False)


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 0, "num_predict": -1},
                                     {"temperature": 0, "num_predict": -7}])
def test_l4_num_predict_unset_or_negative_runs_to_eos(smollm_ollama: ollama.Client,
                                                       smollm_name: str,
                                                       options: dict[str, Any]) -> None:
    """L4: Ollama's default ``num_predict`` is no limit (-1): the greedy answer (75 tokens)
    runs past the engine's default budget to EOS, ``done_reason: "stop"``; any negative value
    means the same, as in Ollama."""
    r = _chat(smollm_ollama, smollm_name, options)
    assert r.done_reason == "stop", (r.done_reason, r.eval_count)
    assert r.eval_count > DEFAULT_MAX_TOKENS
    capped = _chat(smollm_ollama, smollm_name, {"temperature": 0, "num_predict": 10})
    assert capped.done_reason == "length" and capped.eval_count == 10
    assert r.message.content.startswith(capped.message.content)


def test_l4_no_limit_ends_at_the_context_with_length(smollm_ollama: ollama.Client,
                                                     smollm_name: str, smollm_live: Any) -> None:
    """L4, L6: with no ``num_predict`` and no EOS (``ignore_eos``), the output fills the
    context and ends ``done_reason: "length"`` (Coda's ``context_limit``), the prompt's
    tokens plus ``eval_count`` being the whole context."""
    context = smollm_ollama.show(smollm_name).modelinfo["coda.context_length"]
    prompt = "one two three four five six seven eight nine ten " * 98
    body = {"model": smollm_name, "prompt": prompt, "raw": True, "stream": False,
            "ignore_eos": True, "options": {"temperature": 0}}
    r = httpx.post(smollm_live.url + "/api/generate", json=body, timeout=300).json()
    assert r["done_reason"] == "length"
    assert 0 < r["eval_count"] < 64  # NOTE: the prompt left little room; nothing else cut it
    assert len(r["context"]) == context


def test_p1_out_of_openai_range_options_are_ollama_settings(smollm_ollama: ollama.Client,
                                                            smollm_name: str) -> None:
    """P1: what Ollama's sampler does with each value, Coda does: a temperature below 0 and a
    ``top_p`` of 0 are greedy, a ``min_p`` above 1 is 1 (only the best token: greedy), a
    ``top_k`` of 0 or below is off, a ``top_p`` above 1 is 1, and a temperature above 2 samples
    (it was a 400 each)."""
    msgs = [{"role": "user", "content": "Write a word."}]

    def text(options: dict[str, Any]) -> str:
        r = _chat(smollm_ollama, smollm_name, {"num_predict": 8, **options}, msgs)
        return str(r.message.content)

    greedy = text({"temperature": 0})
    assert text({"temperature": -1}) == greedy
    assert text({"temperature": 1.3, "top_p": 0, "seed": 3}) == greedy
    assert text({"temperature": 1.3, "min_p": 2, "seed": 3}) == greedy
    sampled = {"temperature": 1.3, "seed": 11}
    assert text({**sampled, "top_k": -1}) == text({**sampled, "top_k": 0})
    assert text({**sampled, "top_p": 1.5}) == text({**sampled, "top_p": 1})
    hot = _chat(smollm_ollama, smollm_name, {"temperature": 5, "seed": 2, "num_predict": 4}, msgs)
    assert hot.done and hot.eval_count == 4


@pytest.mark.parametrize(("options", "word"), [({"temperature": 101}, "temperature"),
                                               ({"repeat_penalty": 0}, "repeat_penalty"),
                                               ({"presence_penalty": 3}, "presence_penalty")])
def test_p1_options_past_the_sampler_are_a_400(smollm_ollama: ollama.Client, smollm_name: str,
                                               options: dict[str, Any], word: str) -> None:
    """P1: values no sampler setting reads (past Coda's sampler limits) stay a 400 naming the
    option, in Ollama's error shape."""
    with pytest.raises(ollama.ResponseError) as exc:
        _chat(smollm_ollama, smollm_name, {"num_predict": 2, **options})
    assert exc.value.status_code == 400 and word in exc.value.error


def test_p1_seed_minus_one_is_no_seed(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """P1: ``seed: -1`` is Ollama's default, no seed: each request draws afresh (four hot
    samples do not all agree), where a real seed repeats."""
    msgs = [{"role": "user", "content": "Write a word."}]
    hot = {"temperature": 1.8, "num_predict": 8}
    unseeded = {_chat(smollm_ollama, smollm_name, {**hot, "seed": -1}, msgs).message.content
                for _ in range(4)}
    assert len(unseeded) > 1
    seeded = {_chat(smollm_ollama, smollm_name, {**hot, "seed": 9}, msgs).message.content
              for _ in range(2)}
    assert len(seeded) == 1


def test_ps_expires_at_is_ollamas_forever(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """``/api/ps`` gives ``expires_at`` as Ollama does for a model kept forever (now plus
    Go's longest duration, past the 20 years its CLI shows as "Forever"): nothing unloads a
    served model on a timer. ``size_vram`` 0: Coda runs on the CPU."""
    (model,) = smollm_ollama.ps().models
    assert model.model == smollm_name and model.expires_at is not None
    assert model.expires_at > datetime.now(UTC) + timedelta(days=365 * 20)
    assert model.size_vram == 0 and model.context_length == 1024
