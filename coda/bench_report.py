"""``coda bench``'s report: its figures (percentiles, the early-stop comparison, the whole
report), the two-column table it prints and the latency plot it writes (``--plot``), from the
runs of :mod:`coda.bench_workload`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from coda.bench import BenchOptions
    from coda.bench_workload import RunResult


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> Percentiles:
        return Percentiles(percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True)
class EarlyStopReport:
    full_tokens: int
    stopped_tokens: int
    tokens_saved: int
    full_wall_s: float
    stopped_wall_s: float
    time_saved_s: float
    requests_stopped: int     # requests that ended with fewer tokens than the full run
    answers_differ: int       # stopped text != full text
    not_prefix: int           # stopped text is not a prefix of the full text (divergence)


@dataclass(frozen=True)
class BenchReport:
    num_requests: int
    concurrency: int
    max_tokens: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    requests_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    peak_rss_mb: float
    hf_wall_s: float | None = None
    hf_output_tok_s: float | None = None
    speedup_vs_hf: float | None = None
    early_stop: EarlyStopReport | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    utf8_tail: str = "auto"
    utf8_tail_affected: int = 0
    quant_mode: str = ""  # the serving mode the engine resolved
    interrupted_of: int | None = None  # SIGINT: the requests planned (num_requests: finished)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``numpy.percentile``'s default); NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def early_stop_report(full: RunResult, stopped: RunResult) -> EarlyStopReport:
    differ = sum(a != b for a, b in zip(full.texts, stopped.texts, strict=True))
    not_prefix = sum(not a.startswith(b) for a, b in zip(full.texts, stopped.texts, strict=True))
    n_stopped = sum(s < f for f, s in zip(full.tokens, stopped.tokens, strict=True))
    return EarlyStopReport(full.output_tokens, stopped.output_tokens,
                           full.output_tokens - stopped.output_tokens, full.wall_s,
                           stopped.wall_s, full.wall_s - stopped.wall_s, n_stopped, differ,
                           not_prefix)


def render(r: BenchReport, model_dir: Path, opts: BenchOptions) -> Table:
    """The report as a two-column rich table."""
    t = Table(title=f"coda bench — {model_dir.name} (--quant {r.quant_mode or opts.quant})",
              show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")

    def pct(p: Percentiles) -> str:
        return f"{p.p50:.1f} / {p.p90:.1f} / {p.p99:.1f}"

    rows: list[tuple[str, str]] = [("interrupted (SIGINT)", f"after {r.num_requests} of "
                                     f"{r.interrupted_of} requests finished: figures are theirs")
                                    ] if r.interrupted_of is not None else []
    rows += [
        ("requests × max tokens", f"{r.num_requests} × {r.max_tokens}"),
        ("concurrency (most in flight)", str(r.concurrency) + (
            f" (--concurrency {opts.concurrency} > {opts.num_requests} requests)"
            if opts.concurrency > r.concurrency else "")),
        ("prompt tokens (total)", str(r.prompt_tokens)),
        ("output tokens (total)", str(r.output_tokens)),
        ("wall time", f"{r.wall_s:.2f} s"),
        ("output throughput", f"{r.output_tok_s:.1f} tok/s"),
        ("request throughput", f"{r.requests_s:.2f} req/s"),
        ("TTFT p50/p90/p99", f"{pct(r.ttft_ms)} ms"),
        ("ITL p50/p90/p99", f"{pct(r.itl_ms)} ms"),
        ("e2e p50/p99", f"{r.e2e_ms.p50:.1f} / {r.e2e_ms.p99:.1f} ms"),
        ("peak RSS", f"{r.peak_rss_mb:.0f} MiB"),
        ("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(r.finish_reasons.items()))),
        (f"utf8_tail={r.utf8_tail}: requests affected",
         f"{r.utf8_tail_affected} of {r.num_requests}"
         + (" (FAILED decoding_error)" if r.utf8_tail == "fail" else
            " (tail dropped)" if r.utf8_tail == "drop" else
            " (partial last character removed, or FAILED where no budget cut it)")),
    ]
    if r.hf_output_tok_s is not None and r.hf_wall_s is not None:
        rows += [("transformers.generate throughput",
                  f"{r.hf_output_tok_s:.1f} tok/s ({r.hf_wall_s:.2f} s)"),
                 ("speedup vs transformers", f"{r.speedup_vs_hf:.2f}×")]
    if (e := r.early_stop) is not None:
        pct_saved = 100.0 * e.tokens_saved / max(e.full_tokens, 1)
        rows += [("early stop: tokens saved",
                  f"{e.tokens_saved} of {e.full_tokens} ({pct_saved:.1f}%)"),
                 ("early stop: time saved",
                  f"{e.time_saved_s:.2f} s ({e.full_wall_s:.2f} → {e.stopped_wall_s:.2f} s)"),
                 ("early stop: requests stopped", f"{e.requests_stopped} of {r.num_requests}"),
                 ("early stop: answer differs from full", f"{e.answers_differ} of {r.num_requests}"),
                 ("early stop: not a prefix of full", f"{e.not_prefix} of {r.num_requests}")]
    for k, v in rows:
        t.add_row(k, v)
    return t


def write_plot(path: Path, run: RunResult) -> None:
    """PNG with histograms and CDFs of TTFT and inter-token latency (ms)."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: headless backend; no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, (name, vals) in enumerate((("TTFT", run.ttft_s), ("inter-token latency", run.itl_s))):
        ms = sorted(v * 1e3 for v in vals)
        axes[0][col].hist(ms, bins=40, color="tab:blue")
        axes[0][col].set_title(f"{name} histogram")
        axes[0][col].set_xlabel("ms")
        axes[1][col].plot(ms, [(k + 1) / max(len(ms), 1) for k in range(len(ms))])
        axes[1][col].set_title(f"{name} CDF")
        axes[1][col].set_xlabel("ms")
        axes[1][col].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
