"""``coda bench``, ``coda models`` and ``coda trace check``: each refuses a bad argument with
one line and exit 2 (before the model loads, where there is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from coda.commands.loading import fail, refuse_bad_isa, refuse_two_kv_sizes


def run_bench_command(**fields: Any) -> None:
    """Run ``coda bench``'s workload; ``fields`` are :class:`coda.bench.BenchOptions`'."""
    from coda.bench import BenchOptions, run_bench
    from coda.commands.serve_checks import unwritable
    from coda.errors import CodaError
    from coda.models.config import ModelLoadError
    from coda.optional import MissingDependency

    refuse_bad_isa()
    refuse_two_kv_sizes(fields.get("kv_cache_bytes"), fields.get("kv_cache_memory_fraction"),
                        fields.get("memory_budget"))
    try:  # NOTE: a bad option value (--utf8-tail) is refused before the model loads
        opts = BenchOptions(**fields)
    except ValueError as exc:
        fail(str(exc))
    # NOTE: a --plot that cannot be written was a FileNotFoundError traceback (exit 1) after
    # the whole workload had run; said before any work, as serve's --trace is
    if opts.plot is not None and (why := unwritable(opts.plot)) is not None:
        fail(f"--plot {opts.plot}: {why}")
    try:
        report = run_bench(opts)
    except MissingDependency as exc:  # NOTE: raised before any work starts
        fail(str(exc))
    except ModelLoadError as exc:
        fail(f"cannot load model {opts.model_dir or '(default)'}: {exc}")
    except CodaError as exc:  # NOTE: the workload's requests refused (--max-tokens past the context)
        fail(f"{exc.code.value}: {exc.message}")
    if report.interrupted_of is not None:  # NOTE: the shell's convention: 128 + SIGINT
        raise typer.Exit(130)


def show_models(paths: list[str]) -> None:
    """``coda models``: the table of loadable models, then why auto picks what it picks and
    why each other mode would not load; exit 2 when a named PATH cannot be read."""
    from rich.console import Console
    from rich.table import Table

    from coda.models.catalog import list_models, named_entries

    refuse_bad_isa()  # NOTE: the modes listed depend on the kernel build
    table = Table("--model", "kind", "arch", "params", "size", "stored as", "context",
                  "--quant (auto → first)", "read", "path")
    notes: list[str] = []
    entries = list_models(paths)
    for e in entries:
        if e.error:
            # NOTE: the reason below the table, as the modes' are: a long one in a cell squeezed
            # every column of the table (each other row's modes wrapped over several lines)
            table.add_row(e.model, e.kind, "[red]not read (below)", "", "", "", "", "", "",
                          str(e.path))
            notes.append(f"{e.model}: {e.error}")
            continue
        others = [m for m in e.quant_modes if m != e.quant_auto]
        table.add_row(e.model, e.kind, e.arch, f"{e.parameters / 1e6:.1f}M",
                      f"{e.size_bytes / 2**20:.1f} MiB", e.quantization, str(e.context),
                      " ".join([e.quant_auto, *others]), f"{e.read_s:.2f} s", str(e.path))
        # NOTE: why, below the table (issue 19 item 5): auto's choice, then each refusal
        notes.append(f"{e.model}: auto serves {e.why}")
        notes += [f"{e.model}: --quant {m} would not load: {why}" for m, why in e.refused]
    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            # NOTE: rich's own answer is exit 1; the CLI's is a quiet exit 0 (cli._reader_may_leave)
            self.quiet = True
            raise BrokenPipeError

    console = PipeConsole(width=max(Console().width, 160))  # NOTE: paths stay readable in pipes
    console.print(table)
    for line in notes:
        console.print(line, highlight=False, markup=False)
    if failed := [e.model for e in named_entries(entries, paths) if e.error]:
        fail(f"cannot read {', '.join(failed)} (the lines below the table say why)")


def check_trace_file(path: Path, left: list[int] | None = None) -> None:
    """``coda trace check``: exit 1 on a problem (each names its rule), 2 for an unreadable
    file; an empty trace holds every invariant and says it is empty. A cut last line (a server
    killed mid-row) is said on stderr and left out; the whole rows are checked, and a request
    that the kill ended mid-way is still reported (L2: no terminal event): the checker accepts
    only what a run could have written to its end. ``left[0]`` gets the verdict's status before
    anything is printed: a reader that leaves (``| head -1``) does not turn 1 into 0."""
    from coda.trace import TraceReadError, check_trace, read_jsonl
    from coda.trace_rules import requests_of

    cut: list[TraceReadError] = []
    try:
        events = read_jsonl(path, cut)
    except TraceReadError as exc:  # NOTE: it names the file's line (json's is the row's own)
        fail(f"cannot read trace {path}: {exc}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        # NOTE: a missing or non-trace file is a bad argument (exit 2, one line), not a traceback
        fail(f"cannot read trace {path}: {type(exc).__name__}: {exc}")
    if cut:
        # NOTE: was "cannot read trace" and exit 2: nothing of the whole rows was checked
        typer.secho(f"warning: {path}: the last line is cut (its writer stopped mid-row, e.g. "
                    f"killed), the partial row is ignored: {cut[0]}", fg="yellow", err=True)
    problems = check_trace(events)
    # NOTE: a reused id (Python API) names several requests, one after another
    n = sum(len(lives) for lives in requests_of(events).values())
    if problems:
        if left is not None:
            left[0] = 1
        for p in problems:
            typer.secho(p, fg="red")
        typer.echo(f"{len(problems)} problem(s) in {n} request(s), {len(events)} events")
        raise typer.Exit(1)
    if not events:  # NOTE: said, so that a wrong path to an empty file is not read as a pass
        typer.echo(f"ok: the trace is empty (0 requests): {path}")
        return
    typer.echo(f"ok: {n} request(s), {len(events)} events, every invariant holds")
