"""Shared helpers for engine tests: tiny real checkpoints, reference-loop oracle runs."""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import ModelRunner
from coda.engine.types import GenerationRequest
from coda.output import OutputSpec
from coda.stream import EventType, RequestStream
from coda.trace import ListTraceSink, check_trace
from tests.random_checkpoint import make_random_checkpoint
from tests.reference import RunnerModel, SamplerChooser
from tests.reference_loop import generate


@functools.lru_cache(maxsize=4)
def tiny_checkpoint(arch: str = "llama", seed: int = 0) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"coda-{arch}-"))
    return make_random_checkpoint(out, arch=arch, preset="tiny", seed=seed)


@dataclass(frozen=True)
class Outcome:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    state: str


def outcome_of(stream: RequestStream) -> Outcome:
    evs = stream.events_after(-1)
    ids = [t.token_id for e in evs for t in e.tokens]
    term = evs[-1].terminal
    assert evs[-1].type is EventType.TERMINAL and term is not None
    ids += [t.token_id for t in term.trailing_tokens]
    return Outcome(stream.text(), tuple(ids), term.finish_reason.value, term.state.value)


@functools.lru_cache(maxsize=2)
def _reference_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner.from_dir(model_dir, num_blocks=64, block_size=16)


def reference_outcome(model_dir: Path, tokenizer: tokenizers.Tokenizer, req: GenerationRequest,
                      seed: int, eos: frozenset[int], context: int) -> Outcome:
    """Run ``req`` alone through the reference loop on the real runner and sampler."""
    runner = _reference_runner(model_dir)
    spec = OutputSpec(max_tokens=req.max_tokens or context - len(req.prompt_token_ids),
                      eos_token_ids=eos, ignore_eos=req.sampling.ignore_eos,
                      stop_strings=req.stop, stop_token_ids=req.stop_token_ids,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      skip_special_tokens=req.skip_special_tokens)
    sink = ListTraceSink()
    run = generate(req.prompt_token_ids, spec, RunnerModel(runner),
                   SamplerChooser(req.sampling, seed, req.prompt_token_ids, eos), tokenizer,
                   trace=sink)
    assert check_trace(sink.events) == []
    return outcome_of(run.stream)


def cached_blocks_hold_only_output(engine: AsyncEngine, requests: Sequence[GenerationRequest],
                                   token_ids: Sequence[Sequence[int]]) -> bool:
    """L7 under speculation: every block in the prefix cache holds a block-aligned run of some
    request's prompt + returned tokens (never a rejected draft)."""
    bm = engine.core.scheduler.block_manager
    bs = bm.block_size
    known: set[tuple[int, ...]] = set()
    for r, out in zip(requests, token_ids, strict=True):
        ids = list(r.prompt_token_ids) + list(out)
        known |= {tuple(ids[i:i + bs]) for i in range(0, len(ids) - bs + 1, bs)}
    blocks = [b.tokens for b in bm._blocks if b.hash is not None]
    return bool(blocks) and all(tuple(t) in known for t in blocks)


def trace_problems_once_settled(sink: ListTraceSink, timeout: float = 10.0) -> list[str]:
    """``check_trace`` of ``sink``'s rows once they stop changing into a sound trace: the engine
    frees a request's blocks and *then* writes the release row (coda.lifecycle), so an idle
    engine's trace may still lack a row for a moment. A lasting violation (a second release, a
    missing terminal) is still returned after ``timeout``."""
    end = time.monotonic() + timeout
    while (problems := check_trace(list(sink.events))) and time.monotonic() < end:
        time.sleep(0.02)
    return problems
