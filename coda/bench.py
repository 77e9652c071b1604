"""``coda bench``: run a workload on the engine and print throughput and latency (issue 3 item 7,
issue 5 item 5; SPEC P1, P5, D2).

Workload: ``num_requests`` prompts of mixed lengths, deterministic from ``seed`` (text drawn from
a small built-in multilingual list, tokenized with the model's own tokenizer), at most
``concurrency`` in flight, exactly ``max_tokens`` output tokens each (``ignore_eos``; greedy).
Latencies are taken from the *arrival times of stream events* in the reader's event loop, which
is what a client sees: TTFT = submit → first delta, ITL = gap between consecutive deltas,
e2e = submit → terminal. ``--compare-hf`` runs ``transformers.generate`` on the same folder and
the same prompts in static batches of ``concurrency`` (left padding), in the same process.
``--early-stop`` reruns the workload with an :class:`~coda.early_stop.EarlyStopPolicy` and
compares with the plain run (tokens and time saved, answers that differ from the full one).
``--utf8-tail auto|fail|drop`` sets every request's K3 tail policy (default ``auto``: a
partial last character that ``max_tokens`` cut is removed and recorded, the request keeps its
own ending); the report counts the requests it affected (ended FAILED with decoding_error, or
ended with an incomplete UTF-8 tail removed), since ``max_tokens`` may cut a multi-byte
character. A Ctrl-C (SIGINT) during the measured run cancels the requests still running and
prints the report of those that finished (its first row says how many of how many), then the
command exits 130; during the warm-up or the early-stop rerun it exits 130 with no report.

Here: the options, the load, the runs in order and the ``transformers`` comparison. The workload
and its timed run are :mod:`coda.bench_workload`'s; the figures, the table and the plot
:mod:`coda.bench_report`'s.
"""


from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from coda.bench_report import (
    BenchReport,
    EarlyStopReport,
    Percentiles,
    early_stop_report,
    render,
    write_plot,
)
from coda.bench_workload import RunResult, drive_workload, make_workload
from coda.early_stop import EarlyStopPolicy
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig
from coda.models.load_errors import ModelLoadError
from coda.optional import require
from coda.output import UTF8_TAIL_POLICIES


@dataclass(frozen=True)
class BenchOptions:
    """What ``coda bench`` runs; ``model_dir`` None is the embedded default model (any
    ``--model`` form: folder, ``.gguf``, package name)."""

    model_dir: str | Path | None = None
    num_requests: int = 64
    concurrency: int = 32
    max_tokens: int = 64
    quant: str = "auto"  # serving mode (EngineConfig.quant)
    dtype: str | None = None
    compare_hf: bool = False
    early_stop: bool = False
    plot: Path | None = None
    seed: int = 0
    # Early-stop policy of the --early-stop run (confidence = chosen token's probability).
    early_stop_confidence: float = 0.9
    early_stop_min_fraction: float = 0.25
    show_progress: bool = True
    utf8_tail: str = "auto"
    # Serving knobs (issue 9 item 4), as in EngineConfig.
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    memory_budget: str | None = None
    num_threads: int | None = None

    @property
    def in_flight(self) -> int:
        """The most requests in flight at once: ``concurrency``, capped by ``num_requests``
        (``-n 2`` never has 32 running); what the report prints and the engine is sized for."""
        return min(self.concurrency, self.num_requests)

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("num_requests, concurrency and max_tokens must be >= 1")
        if self.utf8_tail not in UTF8_TAIL_POLICIES:  # NOTE: refused before the model loads
            raise ValueError(f"--utf8-tail {self.utf8_tail!r}: use one of "
                             f"{', '.join(UTF8_TAIL_POLICIES)}")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # NOTE: Linux reports KiB


def _run(engine: AsyncEngine, prompts: Sequence[tuple[int, ...]], opts: BenchOptions,
         policy: EarlyStopPolicy | None, console: Console, label: str) -> RunResult:
    if not opts.show_progress:
        return asyncio.run(drive_workload(engine, prompts, opts, policy, None))
    cols = (f"[bold]{label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=True) as progress:
        return asyncio.run(drive_workload(engine, prompts, opts, policy, progress))


def run_hf(model_path: Path, prompts: Sequence[tuple[int, ...]], batch: int, max_tokens: int,
           dtype: str, pad_id: int) -> tuple[float, int]:
    """``transformers.generate`` in static batches, left-padded, greedy, exactly ``max_tokens``
    new tokens per row (``min_new_tokens`` suppresses EOS). Returns (seconds, output tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    # NOTE: from_pretrained returns the model in eval mode already
    if model_path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent),
                                                     gguf_file=model_path.name,
                                                     dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    total = 0
    start = time.perf_counter()
    for b in range(0, len(prompts), batch):
        group = prompts[b:b + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
        total += int(out.shape[0]) * (int(out.shape[1]) - width)
    return time.perf_counter() - start, total


def _load(opts: BenchOptions) -> AsyncEngine:
    """The engine ``opts`` describe; a knob the load refuses (``--max-model-len 0``,
    ``--kv-cache-bytes 5``, a memory budget that does not parse or fit) is a
    :class:`ModelLoadError` with its message, as a model that cannot load is."""
    try:
        return AsyncEngine.from_model_dir(opts.model_dir, EngineConfig(
            quant=opts.quant, dtype=opts.dtype, max_num_seqs=opts.in_flight,
            max_model_len=opts.max_model_len,
            kv_cache_bytes=opts.kv_cache_bytes,
            kv_cache_memory_fraction=opts.kv_cache_memory_fraction,
            memory_budget=opts.memory_budget, num_threads=opts.num_threads))
    except ModelLoadError:
        raise
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def run_bench(opts: BenchOptions, console: Console | None = None) -> BenchReport:
    """Run the workload (and the optional comparisons); print a table; return the figures.
    The table goes to ``console`` (default: stdout); what was loaded and the progress are
    diagnostics: on stderr, unless a ``console`` is given (then everything goes there)."""
    diag = console or Console(stderr=True)
    console = console or Console()
    # NOTE: optional packages are checked before any work (issue 13 item 5)
    if opts.plot is not None:
        require("plot")
    if opts.compare_hf:
        require("compare_hf")
    # NOTE: a Ctrl-C during the load: one line and exit 130 at once, as generate and serve
    # (it was a KeyboardInterrupt traceback, seconds late where the load was in native code)
    from coda.commands.loading import interrupt_exits

    with interrupt_exits("while loading the model (nothing measured)"):
        diag.print(f"loading model {opts.model_dir or '(default)'} ...", style="dim",
                   soft_wrap=True, highlight=False)
        engine = _load(opts)
    for line in engine.describe():
        diag.print(line, style="dim")
    max_prompt = max(1, min(256, engine.context_length - opts.max_tokens - 1))
    prompts = make_workload(engine.tokenizer, opts.num_requests, opts.seed, max_prompt)
    report_hf: tuple[float, int] | None = None
    with engine:
        # NOTE: one short warm-up request so that lazy initialisation is not measured.
        if _run(engine, prompts[:1], BenchOptions(num_requests=1, concurrency=1, max_tokens=2,
                                                  show_progress=False), None, diag,
                "warm-up").interrupted:
            raise KeyboardInterrupt  # NOTE: nothing measured yet: no report to print
        full = _run(engine, prompts, opts, None, diag, "coda")
        rss = peak_rss_mb()
        es: EarlyStopReport | None = None
        if opts.early_stop and not full.interrupted:
            policy = EarlyStopPolicy(
                min_tokens=max(1, int(opts.max_tokens * opts.early_stop_min_fraction)),
                max_tokens=opts.max_tokens, deadline_ms=3_600_000,
                confidence_threshold=opts.early_stop_confidence, no_retry_after_first_frame=True)
            stopped = _run(engine, prompts, opts, policy, diag, "coda + early stop")
            if stopped.interrupted:  # NOTE: half a comparison is none: exit 130 as before
                raise KeyboardInterrupt
            es = early_stop_report(full, stopped)
    if opts.compare_hf and not full.interrupted:
        pad = min(engine.eos_token_ids) if engine.eos_token_ids else 0
        with diag.status("transformers.generate (static batches)…"):
            report_hf = run_hf(engine.model_dir, prompts, opts.in_flight, opts.max_tokens,
                               engine.loaded.dtype, pad)
    reasons: dict[str, int] = {}
    for r in full.reasons:
        reasons[r] = reasons.get(r, 0) + 1
    tok_s = full.output_tokens / full.wall_s
    hf_tok_s = report_hf[1] / report_hf[0] if report_hf is not None else None
    finished = len(full.reasons)
    report = BenchReport(
        num_requests=finished, concurrency=opts.in_flight, max_tokens=opts.max_tokens,
        prompt_tokens=sum(len(prompts[i]) for i in full.done), output_tokens=full.output_tokens,
        wall_s=full.wall_s, output_tok_s=tok_s, requests_s=finished / full.wall_s,
        ttft_ms=_ms(full.ttft_s), itl_ms=_ms(full.itl_s), e2e_ms=_ms(full.e2e_s),
        peak_rss_mb=rss, hf_wall_s=report_hf[0] if report_hf else None, hf_output_tok_s=hf_tok_s,
        speedup_vs_hf=tok_s / hf_tok_s if hf_tok_s else None, early_stop=es,
        finish_reasons=reasons, utf8_tail=opts.utf8_tail,
        utf8_tail_affected=full.utf8_tail_affected, quant_mode=engine.loaded.mode.name,
        interrupted_of=opts.num_requests if full.interrupted else None)
    if opts.plot is not None:
        write_plot(opts.plot, full)
    console.print(render(report, engine.model_dir, opts))
    if opts.plot is not None:
        console.print(f"latency plot written to {opts.plot}")
    return report


def _ms(values: Sequence[float]) -> Percentiles:
    return Percentiles.of([v * 1e3 for v in values])
