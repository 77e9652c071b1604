"""Exact prompt-lookup speculation on a second trained family: Gemma 3 270M (issue 21 item 3;
SPEC T4, L6, L7, S2, O1). Skips where ``/tmp/gemma3-270m-q4_k_m.gguf`` is not here.

Gemma 3 differs from SmolLM2 where speculation could go wrong: five of each six layers attend
through a 512-token sliding window (``coda/models/attention_window.py``: the cache keeps every
key and a local layer masks the old ones, per row), and its vocabulary is 262k tokens. The
prompts are documents followed by their beginning again (a base model continues by copying,
so drafts are accepted and some rejected), sized so that every request decodes across
position 512: verifications whose rows straddle the window's edge, and rejected tails rolled
back there, the next step re-decoding those positions over the local layers' masks. Plain
decoding on the same file is the oracle: token ids, logprobs (and top logprobs), text, finish
reason and usage, greedy and seeded T = 0.8, at batch 1 and as a streamed crowd of 8. Fails
when a verification's rows attend without the local layers' window (the native loop given
window 0 for a step with more rows than sequences), which plain decoding here never needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import GenerationRequest
from coda.sampling import SamplingParams
from coda.trace import ListTraceSink
from tests.engine_support import trace_problems_once_settled
from tests.openai_sweep_support import GEMMA
from tests.test_speculative import SPEC, Result, _engine, _run, _settled, _streamed

# NOTE: 24 requests of ~470 prompt tokens on a 270M model with a 262k vocabulary: about 2
# minutes on an idle 2-core machine, several times that on a shared one
pytestmark = pytest.mark.timeout(900)
WINDOW = 512
MAX_TOKENS = 96


def recite_texts() -> list[str]:
    """Two of the bench's ``recite`` texts: a code file followed by its first five lines again,
    another by five lines from its middle."""
    from benchmarks.spec_workloads import recite_prompts

    texts = recite_prompts()
    return [texts[0], texts[5]]


@pytest.fixture(scope="module")
def gemma() -> Iterator[tuple[AsyncEngine, AsyncEngine, ListTraceSink]]:
    if not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    sink = ListTraceSink()
    cfg: dict[str, Any] = dict(num_blocks=256, max_model_len=1024, enable_prefix_caching=False)
    plain = _engine(str(GEMMA), "off", **cfg)
    spec = _engine(str(GEMMA), SPEC, sink, **cfg)
    yield plain, spec, sink
    plain.shutdown()
    spec.shutdown()


def _requests(engine: AsyncEngine) -> list[GenerationRequest]:
    """8 requests: each text greedy and seeded T = 0.8 (two seeds), and greedy with a stop
    string inside the copied run; every one starts decoding before position 512 and ends past
    it."""
    out = []
    for n, text in enumerate(recite_texts()):
        ids = tuple(engine.tokenizer.encode(text).ids)
        assert ids[0] == engine.tokenizer.token_to_id("<bos>")
        assert len(ids) < WINDOW < len(ids) + MAX_TOKENS, "decoding must cross the edge"
        samplings = [SamplingParams(temperature=0.0, logprobs=2),
                     SamplingParams(temperature=0.8, seed=3 + n, logprobs=2),
                     SamplingParams(temperature=0.8, top_p=0.95, seed=11 + n, logprobs=2)]
        out += [GenerationRequest(ids, s, max_tokens=MAX_TOKENS) for s in samplings]
        out.append(GenerationRequest(ids, samplings[0], max_tokens=MAX_TOKENS, stop=("\n\n",)))
    return out


def _key(r: Result) -> tuple[Any, ...]:
    return (r.signature, r.text, r.finish_reason, r.usage)


def test_t4_l6_gemma3_speculation_equals_plain_alone_and_streamed_in_a_crowd(
        gemma: tuple[AsyncEngine, AsyncEngine, ListTraceSink]) -> None:
    """T4, L6, L7, O1: batch 1 and a streamed crowd of 8, greedy and seeded: the speculative
    engine's tokens, logprobs, text, finish reasons and usage are plain decoding's; drafts
    were accepted and rejected, verifications straddled the sliding window's edge; every
    block is free after and the trace adds up."""
    plain, spec, sink = gemma
    reqs = [replace(r, request_id=f"g{i}") for i, r in enumerate(_requests(plain))]
    want = [_key(w) for w in _run(plain, reqs, crowd=False)]
    alone = _run(spec, reqs, crowd=False)
    assert [_key(g) for g in alone] == want
    crowd = _streamed(spec, [replace(r, request_id=f"c{i}") for i, r in enumerate(reqs)])
    assert [_key(g) for g in crowd] == want
    for got in (alone, crowd):
        counts = [g.speculative or {} for g in got]
        assert all(c["drafted"] == c["accepted"] + c["rejected"] for c in counts)
        assert sum(c["accepted"] for c in counts) > 0, "no draft accepted: nothing proved"
    assert {w[2] for w in want} >= {"max_output_tokens", "stop_sequence"}
    # NOTE: (position of a verification's first row, drafted, rejected); the crowd's ids are
    # c<i> for the alone run's g<i>, with the same prompt
    prompt = {r.request_id[1:]: len(r.prompt_token_ids) for r in reqs if r.request_id}
    rows = [(prompt[e.request_id[1:]] + e.data["t"] - 1, e.data["drafted"], e.data["rejected"])
            for e in sink.events if e.kind == tr.SPECULATIVE and e.request_id]
    assert any(p < WINDOW <= p + d for p, d, _ in rows), "no verification straddled the edge"
    assert any(x > 0 and p >= WINDOW for p, d, x in rows), "no tail rejected past the edge"
    assert _settled(spec)
    assert trace_problems_once_settled(sink) == []
