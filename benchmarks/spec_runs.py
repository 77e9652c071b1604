"""The runner of ``benchmarks/bench_speculative.py`` (issue 21): one set of requests on an
engine (or on llama.cpp) timed on the bench's clock, with its outcomes for the byte comparison
and the speculative counts; the forward cost of ``1 + k`` rows; ``--draft-model``'s argument.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import GenerationRequest

# NOTE: set by the bench's --clock (bench_speculative.main)
CPU_CLOCK = False


def _clock() -> float:
    """Wall time, or with ``--clock cpu`` this process's CPU time (all threads): on a machine
    shared with other jobs it leaves out the waits for a core, which wall time counts."""
    return time.process_time() if CPU_CLOCK else time.perf_counter()


@dataclass
class RunResult:
    seconds: float
    tokens: int
    outcomes: list[tuple[object, ...]]
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    lengths: list[int] = field(default_factory=list)  # NOTE: selected tokens per request


def run_set(engine: AsyncEngine, reqs: list[GenerationRequest], batch: int) -> RunResult:
    handles = []
    start = _clock()
    for i in range(0, len(reqs), batch):
        group = engine.submit_all(reqs[i:i + batch])
        for h in group:
            h.wait(3600)
        handles += group
    seconds = _clock() - start
    res = RunResult(seconds, 0, [])
    for h in handles:
        evs = h.stream.events_after(-1)
        term = evs[-1].terminal
        assert term is not None
        infos = [t for e in evs for t in e.tokens] + list(term.trailing_tokens)
        res.tokens += term.usage.selected_tokens
        res.lengths.append(term.usage.selected_tokens)
        res.outcomes.append((h.stream.text(), tuple(t.token_id for t in infos),
                             tuple(t.logprob for t in infos), term.finish_reason, term.usage))
        if term.speculative is not None:
            res.drafted += term.speculative["drafted"]
            res.accepted += term.speculative["accepted"]
            res.verify_steps += term.speculative["verify_steps"]
    return res


def llamacpp(path: str, capacity: int, threads: int | None) -> Any:
    """llama.cpp on ``path`` (one sequence), or None where ``llama_cpp`` is not importable or
    the file is not a GGUF (the reason printed)."""
    if not path.endswith(".gguf"):
        print("llama.cpp: skipped (--model is not a GGUF file)")
        return None
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        print(f"llama.cpp: skipped (llama_cpp not importable: {exc})")
        return None
    from benchmarks.bench_vs_llamacpp import LlamaCppRun

    return LlamaCppRun(Path(path), capacity, 1, threads or os.cpu_count() or 1)


def llamacpp_set(run: Any, reqs: list[GenerationRequest], lengths: list[int]) -> RunResult:
    """llama.cpp's plain (greedy argmax) decoding of ``reqs`` one after another, request
    ``i`` for ``lengths[i]`` tokens (Coda's plain run's), on :func:`_clock`."""
    start = _clock()
    tokens = 0
    for r, n in zip(reqs, lengths, strict=True):
        if n > 0:
            tokens += len(run.generate([list(r.prompt_token_ids)], n)[2][0])
    return RunResult(_clock() - start, tokens, [])


def _decode_tps(full: RunResult, first: RunResult) -> float:
    """Tokens after each request's first over the time past the prefills and first picks."""
    return (full.tokens - first.tokens) / max(full.seconds - first.seconds, 1e-9)


def row_costs(engine: AsyncEngine, ks: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8),
              context: int = 400, repeats: int = 8) -> list[tuple[int, float]]:
    """Median ms (``_clock``) of one forward of ``1 + k`` rows of one sequence at ``context``:
    what a verification of k drafts costs (the model's fixed cost per step, ``step_rows`` of
    coda.engine.speculative, is read off it)."""
    from coda.engine.runner import SeqChunk

    runner = engine.runner
    blocks = -(-(context + max(ks) + 1) // runner.block_size)
    table = tuple(range(blocks))
    runner.execute([SeqChunk(tuple(range(200, 200 + context)), 0, table, True)])
    out = []
    for k in ks:
        times = []
        for _ in range(repeats):
            start = _clock()
            runner.execute([SeqChunk(tuple(range(300, 301 + k)), context, table, True, 1 + k)])
            times.append(_clock() - start)
        out.append((k, 1e3 * statistics.median(times)))
    return out


def _draft_model(model: str, draft: str | None) -> str | None:
    """``--draft-model`` as a model argument (``cut:N`` written to a temporary GGUF)."""
    if draft is None or not draft.startswith("cut:"):
        return model if draft == "self" else draft
    import tempfile

    from coda.models.source import resolve_model
    from tests.draft_fixtures import cut_gguf

    layers = int(draft.split(":", 1)[1])
    out = Path(tempfile.mkdtemp(prefix="coda-draft-")) / f"cut{layers}.gguf"
    return str(cut_gguf(resolve_model(model).path, out, layers))
