"""``benchmarks/profile_speculative.py`` (issue 21's where-the-time-goes profile) runs against
the engine as it is: it wraps the engine's step, drafting and choosing by their current homes
(the choosing is ``coda.engine.core_choose.choose`` since the engine's speculation split), times
each part, and puts every one back afterwards."""

from __future__ import annotations

from pathlib import Path

from benchmarks import profile_speculative as prof
from coda.engine import core as core_module
from coda.engine import core_choose
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest


def test_profile_speculative_times_each_part_and_restores_the_engine(
        server_checkpoint: Path) -> None:
    """A prompt-lookup run through ``profile_speculative.run``: every chosen token passes the
    timed choose, the forwards are counted, and the engine's own functions are back after it."""
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
        speculative="prompt-lookup", num_blocks=64))
    with engine:
        split, tokens = prof.run(engine, [GenerationRequest((5, 6, 7, 5, 6, 7, 5, 6),
                                                            max_tokens=6)], None)
        assert core_module.choose is core_choose.choose
        assert "step" not in vars(engine.core) and "_drafts" not in vars(engine.core)
    assert 1 <= tokens <= 6
    assert split.n["choose"] >= 1 and split.n["prefill"] >= 1
    assert split.step > 0 and split.s["choose"] > 0
