"""The typed seam between server and engine (issue 11 item 3; SPEC P1, P3, C1): AsyncEngine is
an ``Engine``, ``attach`` resumes a log after any seq, ``cancel`` reaches a request by id, and
what crosses the seam is plain data (pickles, and round-trips the log codec)."""

from __future__ import annotations

import asyncio
import pickle

from coda.durable.codec import decode_event, encode_event
from coda.engine.async_engine import AsyncEngine
from coda.engine.protocol import Engine, EngineHandle, ModelInfo
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import CancelCause, FinishReason
from coda.sampling import SamplingParams
from coda.stream import EventType, StreamEvent
from tests.engine_support import tiny_checkpoint


async def _collect(it: object) -> list[StreamEvent]:
    return [ev async for ev in it]  # type: ignore[attr-defined]


def test_async_engine_is_the_engine_protocol_p1_p3_c1() -> None:
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(max_num_seqs=4))
    assert isinstance(engine, Engine)
    with engine:
        req = GenerationRequest((1, 2, 3), SamplingParams(seed=7), max_tokens=6,
                                request_id="seam-1")
        handle = engine.submit(req)
        assert isinstance(handle, EngineHandle)
        handle.wait(60)
        full = asyncio.run(_collect(engine.attach("seam-1", -1)))
        assert [e.seq for e in full] == list(range(len(full)))
        assert full[0].type is EventType.START and full[-1].type is EventType.TERMINAL
        for k in range(-1, len(full)):  # P3: resume after any seq gives exactly the rest
            tail = asyncio.run(_collect(engine.attach("seam-1", k)))
            assert [e.seq for e in tail] == [e.seq for e in full[k + 1:]]
        # plain data: pickles (a Ray hop) and round-trips the log codec (the Redis log)
        for ev in full:
            assert pickle.loads(pickle.dumps(ev)) == ev
            back = decode_event(encode_event(ev))
            assert (back.seq, back.type, back.data, back.tokens, back.terminal) == (
                ev.seq, ev.type, ev.data, ev.tokens, ev.terminal)
        info = engine.model_info()
        assert pickle.loads(pickle.dumps(info)) == info
        assert isinstance(info, ModelInfo)
        assert (info.name, info.context_length, info.eos_token_ids) == (
            engine.model_name, engine.context_length, engine.eos_token_ids)
        # NOTE: what Ollama's /api/show describes (coda.server.ollama_info)
        mc = engine.runner.config
        assert (info.architecture, info.parameters) == (mc.arch, mc.num_parameters)
        assert info.quantization == engine.loaded.quantization
        # C1: cancel by id reaches a running request once; unknown or ended ids say False
        slow = engine.submit(GenerationRequest((1, 2, 3), SamplingParams(seed=1),
                                               request_id="seam-2"))
        assert engine.cancel("seam-2", CancelCause.CLIENT)
        term = slow.wait(60)
        assert term.finish_reason in (FinishReason.CANCELLED, FinishReason.MAX_OUTPUT_TOKENS,
                                      FinishReason.CONTEXT_LIMIT, FinishReason.EOS)
        assert not engine.cancel("seam-2") and not engine.cancel("nope")
        assert pickle.loads(pickle.dumps(engine.stats())) == engine.stats()
