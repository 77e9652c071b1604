"""The batched engine against the reference loop, on a real (tiny, random) checkpoint
(T3, T4, G1, C1–C3, L2, L7, P2; issue 3 item 5)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import ModelRunner
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.sampling import SamplingParams
from coda.stream import EventType
from coda.trace import ListTraceSink, check_trace

from .engine_support import outcome_of, reference_outcome, tiny_checkpoint


def make_requests(n: int, rng: random.Random, vocab: int) -> list[GenerationRequest]:
    reqs = []
    for i in range(n):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 40)))
        if i % 2:
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1000 + i)
        reqs.append(GenerationRequest(prompt, params, max_tokens=rng.randint(1, 24),
                                      stop=("ab",) if i % 3 == 0 else ()))
    return reqs


def run_engine(engine: AsyncEngine, reqs: list[GenerationRequest]) -> list:
    handles = [engine.submit(r) for r in reqs]
    return [h.wait(120) and outcome_of(h.stream) for h in handles]


@pytest.mark.parametrize("concurrency,num_blocks", [(1, 256), (8, 256), (32, 256), (32, 20)])
def test_t3_t4_engine_equals_reference_loop(concurrency: int, num_blocks: int) -> None:
    """Same bytes, tokens and finish reasons as the reference loop, alone or batched, with
    and without preemption (T3: batch of mixed lengths; T4: preemption is invisible)."""
    model_dir = tiny_checkpoint()
    sink = ListTraceSink()
    cfg = EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=concurrency,
                       max_num_batched_tokens=64, long_prefill_chunk=16)
    engine = AsyncEngine.from_model_dir(model_dir, cfg, trace=sink)
    rng = random.Random(concurrency * 7 + num_blocks)
    reqs = make_requests(max(concurrency, 8), rng, engine.runner.config.vocab_size)
    seeds = [r.sampling.seed if r.sampling.seed is not None else 0 for r in reqs]
    with engine:
        got = run_engine(engine, reqs)
        stats = engine.stats()
    want = [reference_outcome(model_dir, engine.tokenizer, r, s, engine.eos_token_ids,
                              engine.context_length) for r, s in zip(reqs, seeds, strict=True)]
    assert got == want
    assert check_trace(sink.events) == []
    assert stats.num_free_blocks == stats.num_blocks  # L7: every block back
    if num_blocks == 20:
        assert stats.num_preemptions_total > 0


def test_c1_c3_cancel_mid_stream_stops_at_a_safe_point() -> None:
    model_dir = tiny_checkpoint()
    sink = ListTraceSink()
    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(num_blocks=128), trace=sink)

    async def main() -> None:
        h = engine.submit(GenerationRequest((5, 6, 7), SamplingParams(temperature=0.0,
                                                                      ignore_eos=True),
                                            max_tokens=500))
        others = [engine.submit(GenerationRequest((9, 10 + i), SamplingParams(temperature=0.0),
                                                  max_tokens=8)) for i in range(4)]
        n = 0
        async for ev in h.events():
            if ev.type is EventType.DELTA:
                n += 1
                if n == 3:
                    assert h.cancel()
            if ev.type is EventType.TERMINAL:
                assert ev.terminal is not None
                assert ev.terminal.state is State.CANCELLED
                assert ev.terminal.finish_reason is FinishReason.CANCELLED
        assert h.stream.events_after(-1)[-1].type is EventType.TERMINAL
        for o in others:
            t = await o.result()
            assert t.state is not State.CANCELLED and t.usage.selected_tokens >= 1
        assert not h.cancel()  # already terminal: nothing to cancel

    with engine:
        asyncio.run(main())
        stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert check_trace(sink.events) == []


def test_g3_deadline_exceeded_in_engine_is_not_cancelled(server_checkpoint: Path) -> None:
    # NOTE: the ASCII-tokenizer checkpoint never ends mid-character (no K3 failure at drain)
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(num_blocks=128))
    with engine:
        h = engine.submit(GenerationRequest((5, 6), SamplingParams(temperature=0.0,
                                                                   ignore_eos=True),
                                            max_tokens=500, deadline_s=0.05))
        t = h.wait(60)
    assert t.finish_reason is FinishReason.DEADLINE_EXCEEDED and t.state is State.FINISHED


class FaultyRunner(ModelRunner):
    """Fails any chunk that contains the poison token id."""

    POISON = 7

    def execute(self, chunks):  # type: ignore[no-untyped-def]
        if any(self.POISON in c.token_ids for c in chunks):
            raise RuntimeError("injected device fault")
        return super().execute(chunks)


def test_l4_injected_forward_failure_fails_only_that_request() -> None:
    model_dir = tiny_checkpoint()
    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(num_blocks=128))
    engine.core.runner = FaultyRunner(engine.runner.model, num_blocks=128)
    engine.runner = engine.core.runner
    sink = ListTraceSink()
    engine.trace = sink
    engine.core.trace = sink
    with engine:
        bad = engine.submit(GenerationRequest((5, FaultyRunner.POISON), max_tokens=4))
        good = [engine.submit(GenerationRequest((5, 8 + i), SamplingParams(temperature=0.0),
                                                max_tokens=6)) for i in range(5)]
        tb = bad.wait(60)
        tg = [g.wait(60) for g in good]
        stats = engine.stats()
    assert tb.state is State.FAILED and tb.finish_reason is FinishReason.MODEL_ERROR
    assert tb.error_code is not None and tb.error_code.value == "model_error"
    # the others end normally (a random model may end on a partial UTF-8 character, which
    # K3 turns into a decoding error — still not a model error)
    assert all(t.finish_reason is not FinishReason.MODEL_ERROR or
               (t.error_code is not None and t.error_code.value == "decoding_error") for t in tg)
    assert all(t.usage.selected_tokens == 6 for t in tg)
    assert stats.num_free_blocks == stats.num_blocks


def test_l6_usage_counts_and_prefix_cache() -> None:
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=128,
                                                                        block_size=4))
    prompt = tuple(range(10, 30))
    with engine:
        t1 = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=0.0,
                                                                    ignore_eos=True),
                                             max_tokens=5)).wait(60)
        t2 = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=0.0,
                                                                    ignore_eos=True),
                                             max_tokens=5)).wait(60)
    for t in (t1, t2):
        assert t.usage.selected_tokens == 5 and t.usage.processed_output_tokens == 4
        assert t.usage.prompt_tokens == 20
    assert t1.usage.cached_prompt_tokens == 0 and t1.usage.processed_prompt_tokens == 20
    assert t2.usage.cached_prompt_tokens > 0
    assert t2.usage.cached_prompt_tokens + t2.usage.processed_prompt_tokens == 20


def test_bad_requests_raise_typed_errors_before_any_work() -> None:
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=64))
    with pytest.raises(InvalidRequestError) as e:
        engine.submit(GenerationRequest(()))
    assert e.value.field == "prompt"
    with pytest.raises(ContextLengthExceededError):
        engine.submit(GenerationRequest(tuple([5] * (engine.context_length + 1))))
    with pytest.raises(InvalidRequestError) as e:
        engine.submit(GenerationRequest((5,), stop=("",)))
    assert e.value.field == "stop"
    with pytest.raises(InvalidRequestError) as e:  # S1 (issue 8 defect 9): a lone surrogate
        engine.submit(GenerationRequest((5,), stop=("ok\ud800",)))
    assert e.value.field == "stop"
    with pytest.raises(InvalidRequestError) as e:
        engine.submit(GenerationRequest((5,), SamplingParams(logit_bias={10**9: 1.0})))
    assert engine.stats().num_requests_total == 0


def test_p6_pause_policy_keeps_memory_bounded_with_a_reader_that_never_reads() -> None:
    from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy

    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=128))
    bp = BackpressureConfig(BackpressurePolicy.PAUSE, pause_bytes=16, max_bytes=1024)
    with engine:
        h = engine.submit(GenerationRequest((5, 6), SamplingParams(temperature=0.0,
                                                                   ignore_eos=True),
                                            max_tokens=400, backpressure=bp))
        import time

        time.sleep(0.5)
        assert not h.stream.closed  # paused, not finished
        assert h.stream.unacked_bytes < 16 + 64
        h.stream.ack(h.stream.last_seq)  # the reader catches up once
        time.sleep(0.2)
        h.cancel()
        t = h.wait(30)
    assert t.state is State.CANCELLED


class CancellingRunner(ModelRunner):
    """Requests a cancel of ``target`` while the forward of step ``at_call`` is in flight."""

    def __init__(self, base: ModelRunner) -> None:
        super().__init__(base.model, num_blocks=base.num_blocks, block_size=base.block_size)
        self.calls = 0
        self.at_call = 4
        self.target = None

    def execute(self, chunks):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == self.at_call and self.target is not None:
            self.target.cancel()
        return super().execute(chunks)


def test_c2_cancel_while_the_forward_is_in_flight_discards_its_result() -> None:
    """The step in flight completes; its logits are never used: no token is selected after the
    cancel was requested, no delta follows the terminal (C2, C3, T2)."""
    sink = ListTraceSink()
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=64),
                                        trace=sink)
    runner = CancellingRunner(engine.runner)
    engine.runner = engine.core.runner = runner
    with engine:
        h = engine.submit(GenerationRequest((5, 6), SamplingParams(temperature=0.0,
                                                                   ignore_eos=True),
                                            max_tokens=50))
        runner.target = h
        t = h.wait(30)
    assert t.state is State.CANCELLED and t.usage.selected_tokens == runner.at_call - 1
    kinds = [e.kind for e in sink.events]
    assert "token.selected" not in kinds[kinds.index("cancel.requested"):]
    assert check_trace(sink.events) == []


@pytest.mark.parametrize("policy", ["buffer", "pause"])
def test_p6_hundred_readers_that_never_read_stay_bounded(policy: str) -> None:
    """100 streams nobody reads: memory stays bounded by the per-stream bound; overflow ends
    with its own error (never a silently dropped delta), pause keeps the request waiting."""
    from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy

    bound = 48
    bp = BackpressureConfig(BackpressurePolicy(policy), pause_bytes=16, max_bytes=bound)
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=512,
                                                                        max_num_seqs=100))
    with engine:
        handles = [engine.submit(GenerationRequest((5, 6 + i % 50), SamplingParams(
            temperature=0.0, ignore_eos=True), max_tokens=200, backpressure=bp))
            for i in range(100)]
        if policy == "buffer":
            terms = [h.wait(60) for h in handles]
            assert all(t.error_code is not None and t.error_code.value == "backpressure_overflow"
                       and t.finish_reason is FinishReason.TRANSPORT_ERROR for t in terms)
        else:
            import time

            time.sleep(1.0)
            assert not any(h.stream.closed for h in handles)
            for h in handles:
                h.cancel()
            terms = [h.wait(60) for h in handles]
            assert all(t.state is State.CANCELLED for t in terms)
        assert all(h.stream.unacked_bytes <= bound for h in handles)
        stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
