"""Smoke tests of ``coda bench`` (issue 3 item 7, issue 5 item 5): the report has its fields and
its counts add up. Timing values are not asserted (shared CI machines)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coda.bench import BenchOptions, run_bench, run_hf
from coda.bench_report import percentile
from coda.bench_workload import make_workload
from coda.cli import app
from coda.engine.async_engine import AsyncEngine
from tests.random_checkpoint import make_random_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # NOTE: a 2-layer, 64-wide model keeps the whole file to a few seconds on 2 cores.
    return make_random_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", preset="tiny",
                                  hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def test_p5_cli_bench_prints_every_field(tiny_dir: Path) -> None:
    """`coda bench` on 4 requests × 4 tokens prints throughput and latency percentiles (P5)."""
    res = CliRunner().invoke(app, ["bench", "--model", str(tiny_dir), "-n", "4",
                                   "--concurrency", "2", "--max-tokens", "4"])
    assert res.exit_code == 0, res.output
    for name in ("output throughput", "request throughput", "TTFT p50/p90/p99",
                 "ITL p50/p90/p99", "e2e p50/p99", "peak RSS", "output tokens (total)"):
        assert name in res.output, name
    assert "max_output_tokens=" in res.output


def test_p5_cli_bench_prints_the_concurrency_that_ran(tiny_dir: Path) -> None:
    """P5: ``coda bench -n 2`` (default ``--concurrency 32``) had at most 2 requests in
    flight: the table says 2 and why, and the engine is sized for 2 (``max_num_seqs 2``).
    Before, it printed concurrency 32 — a figure that did not describe the run."""
    res = CliRunner().invoke(app, ["bench", "--model", str(tiny_dir), "-n", "2",
                                   "--max-tokens", "2"])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if "most in flight" in line)
    assert row.split("│")[2].strip() == "2 (--concurrency 32 > 2 requests)", row
    assert "max_num_seqs 2" in res.output, res.output


def test_p5_run_bench_report_counts_and_plot(tiny_dir: Path, tmp_path: Path) -> None:
    """Every request yields exactly max_tokens tokens (ignore_eos), one TTFT and one e2e each;
    the plot is a PNG."""
    png = tmp_path / "lat.png"
    console = Console(width=120, record=True)
    rep = run_bench(BenchOptions(model_dir=tiny_dir, num_requests=4, concurrency=2, max_tokens=4,
                                 plot=png, show_progress=False), console)
    assert rep.output_tokens == 16
    # NOTE: a random model may end mid-character; utf8_tail auto (the default) removes the
    # partial character and the request keeps its reason, never FAILED (issue 20)
    assert sum(rep.finish_reasons.values()) == 4
    assert set(rep.finish_reasons) == {"max_output_tokens"}
    assert rep.output_tok_s > 0 and rep.requests_s > 0 and rep.peak_rss_mb > 0
    assert rep.ttft_ms.p50 <= rep.ttft_ms.p99 and rep.e2e_ms.p50 <= rep.e2e_ms.p99
    assert rep.ttft_ms.p99 <= rep.e2e_ms.p99
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ITL p50/p90/p99" in console.export_text()


def test_d2_bench_early_stop_reports_savings(tiny_dir: Path) -> None:
    """--early-stop with threshold 0 stops every request at min_tokens: tokens are saved and the
    stopped answers are prefixes of the full ones (greedy, seed 004 D2)."""
    console = Console(width=120, record=True)
    rep = run_bench(BenchOptions(model_dir=tiny_dir, num_requests=4, concurrency=2, max_tokens=8,
                                 early_stop=True, early_stop_confidence=0.0,
                                 early_stop_min_fraction=0.5, show_progress=False), console)
    es = rep.early_stop
    assert es is not None
    assert es.full_tokens == 32
    assert es.requests_stopped == 4
    assert es.stopped_tokens == 16 and es.tokens_saved == 16
    assert es.not_prefix == 0
    assert "early stop: tokens saved" in console.export_text()


def test_k3_bench_reports_how_many_requests_each_utf8_tail_policy_affected(tiny_dir: Path
                                                                          ) -> None:
    """K3: the same greedy workload under ``fail``, ``drop`` and ``auto`` (the default) affects
    the same requests: FAILED decoding_error under ``fail``, FINISHED with a dropped tail under
    ``drop`` and ``auto`` (max_tokens cut the character, issue 20)."""
    reps = {}
    for policy in ("fail", "drop", "auto"):
        console = Console(width=120, record=True)
        reps[policy] = run_bench(BenchOptions(model_dir=tiny_dir, num_requests=8, concurrency=4,
                                              max_tokens=5, utf8_tail=policy,
                                              show_progress=False), console)
        assert f"utf8_tail={policy}: requests affected" in console.export_text()
    fail, drop = reps["fail"], reps["drop"]
    assert fail.utf8_tail_affected == fail.finish_reasons.get("max_output_tokens:decoding_error", 0)
    assert drop.utf8_tail_affected == fail.utf8_tail_affected > 0
    assert set(drop.finish_reasons) == {"max_output_tokens"}
    assert reps["auto"].utf8_tail_affected == fail.utf8_tail_affected
    assert set(reps["auto"].finish_reasons) == {"max_output_tokens"}


def test_p5_workload_is_deterministic_and_mixed(tiny_dir: Path) -> None:
    eng = AsyncEngine.from_model_dir(tiny_dir)
    a = make_workload(eng.tokenizer, 32, 7, 256)
    assert a == make_workload(eng.tokenizer, 32, 7, 256)
    assert a != make_workload(eng.tokenizer, 32, 8, 256)
    lengths = {len(p) for p in a}
    assert min(lengths) < 16 and max(lengths) > 64 and max(lengths) <= 256


def test_p5_compare_hf_generates_exactly_max_tokens(tiny_dir: Path) -> None:
    """--compare-hf: static left-padded batches, a partial last batch, max_tokens per row."""
    secs, tokens = run_hf(tiny_dir, [(5, 6, 7), (8,), (9, 10)], 2, 3, "float32", 0)
    assert tokens == 9 and secs > 0


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 90) == 90.0
    assert math.isnan(percentile([], 50))
