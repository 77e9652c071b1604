"""The load summary's KV line says one thing (SPEC T3's capacity, as the engine admits): the
full contexts the budget reserved are the sequences x context it reports, also where the
context is no multiple of the 16-token block (``--max-model-len 4`` read "4 full contexts",
then "64 tokens = 16 sequences x 4 context": a sequence takes a whole block)."""

from __future__ import annotations

import re

import pytest

from coda.engine.kv_budget import kv_capacity


@pytest.mark.parametrize(("blocks", "bs", "ctx", "seqs"), [
    (4, 16, 4, 4), (512, 16, 2048, 4), (12, 16, 64, 3), (9, 16, 20, 4), (10, 16, 2048, 0),
])
def test_t3_capacity_counts_whole_blocks_per_sequence(blocks: int, bs: int, ctx: int,
                                                      seqs: int) -> None:
    line = kv_capacity(blocks, bs, ctx)
    assert f"{blocks * bs} tokens in blocks of {bs}: {seqs} sequences x {ctx} context" in line
    assert ("whole blocks" in line) == (ctx % bs != 0)


@pytest.mark.parametrize("max_model_len", [4, 20, 64])
def test_t3_load_summary_full_contexts_equal_its_sequences(max_model_len: int) -> None:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_model_len=max_model_len,
                                                           max_num_seqs=4))
    try:
        line = next(x for x in engine.describe() if x.startswith("KV cache:"))
    finally:
        engine.shutdown()
    full = re.search(r"\((\d+) full contexts", line)
    seqs = re.search(r"(\d+) sequences x (\d+) context", line)
    assert full and seqs, line
    assert full.group(1) == seqs.group(1) == "4" and seqs.group(2) == str(max_model_len), line
