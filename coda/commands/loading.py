"""What every model-loading command does first: refuse a bad kernel build, load the engine and
tell what was loaded; a failure is one red line and exit 2, never a stack trace."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import typer


def fail(message: str) -> NoReturn:
    """``error: message`` in red on stderr and exit 2 (a bad argument: before any work)."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2) from None


def refuse_exact_and_fraction(kv_cache_bytes: int | None, kv_cache_fraction: float | None) -> None:
    """``--kv-cache-bytes`` with ``--kv-cache-fraction`` (every command that takes them): one
    line and exit 2 before any work. The exact size won and the fraction was silently ignored
    (the precedence of :mod:`coda.engine.kv_budget`, which the Python API keeps)."""
    if kv_cache_bytes is not None and kv_cache_fraction is not None:
        fail("--kv-cache-bytes and --kv-cache-fraction both size the KV cache: give one "
             "(--kv-cache-bytes is exact and ignored the fraction)")


def refuse_two_kv_sizes(kv_cache_bytes: int | None, kv_cache_fraction: float | None,
                        memory_budget: str | None) -> None:
    """``coda generate``/``bench``: ``--kv-cache-bytes`` or ``--kv-cache-fraction`` together
    with ``--memory-budget`` is one line and exit 2 before any work. Each sizes the one model's
    KV cache; the exact size won and the budget was silently ignored (``--kv-cache-fraction 0.5
    --memory-budget 1GiB`` reserved 1440 MiB of KV). ``coda serve``'s ``--memory-budget`` is
    the several-models router's, which each model's cache is then sized within: no conflict."""
    refuse_exact_and_fraction(kv_cache_bytes, kv_cache_fraction)
    if memory_budget is None:
        return
    for flag, value in (("--kv-cache-bytes", kv_cache_bytes),
                        ("--kv-cache-fraction", kv_cache_fraction)):
        if value is not None:
            fail(f"{flag} and --memory-budget both size the KV cache: give one (--memory-budget "
                 f"bounds weights + KV cache; {flag} sets the cache alone, ignoring the budget)")


def refuse_bad_isa() -> None:
    """A ``CODA_KERNEL_ISA`` that names no build this CPU runs: one line and exit 2 before any
    work (it was a silent fallback to the torch path: another mode, other output)."""
    from coda.models.kernels import KernelIsaError, check_isa

    try:
        check_isa()
    except KernelIsaError as exc:
        fail(str(exc))


def engine_config(**fields: Any) -> Any:
    """``EngineConfig(**fields)``; a value it refuses (:class:`EngineConfigError`: a count, the
    KV fraction, the speculative mode) is one red line and exit 2, before any model loads."""
    from coda.engine.types import EngineConfig, EngineConfigError

    try:
        return EngineConfig(**fields)
    except EngineConfigError as exc:
        fail(str(exc))


def load_engine(model: str | None, cfg: Any, say: Any = None) -> Any:
    """Load the engine and tell what was loaded (``say``: a logger method, which also gets one
    ``model loaded`` record carrying :meth:`AsyncEngine.load_summary` as fields; default:
    plain lines on stderr); a load failure, an unknown ``--quant`` or one that does not apply
    to the model included, exits 2 with its message."""
    from coda.engine.async_engine import AsyncEngine
    from coda.models.config import ModelLoadError
    from coda.models.load_errors import DraftModelLoadError

    if model is not None and not model.strip():  # NOTE: an unset ``--model "$MODEL"``
        fail("--model is empty: give a folder, a .gguf file or a package, or omit it for the "
             "embedded model")
    # NOTE: loading takes seconds to minutes: say what is happening before it starts
    announce = say if say is not None else (lambda line: typer.echo(line, err=True))
    announce(f"loading model {'(default)' if model is None else model} ...")
    try:
        engine = AsyncEngine.from_model_dir(model, cfg)
    except (ModelLoadError, ValueError) as exc:
        # NOTE: a draft's failure names the draft and its flag itself, never the target
        what = "" if isinstance(exc, DraftModelLoadError) else \
            f"cannot load model {'(default)' if model is None else model}: "
        fail(f"{what}{exc}")
    if say is None:
        for line in engine.describe():
            typer.echo(line, err=True)
    else:
        for line in engine.describe():
            say(line)
        # O1: one JSON line with what was loaded, the serving mode and its numerics included
        say("model loaded", extra=engine.load_summary())
    return engine


@contextlib.contextmanager
def interrupt_exits(what: str, say: Callable[[str], Any] | None = None) -> Iterator[None]:
    """SIGINT/SIGTERM while a model loads (before any request runs): one line saying so
    (``interrupted (SIGINT) <what>: exiting``), then
    exit 128 + the signal at once. A Ctrl-C there was a KeyboardInterrupt: silent (typer
    turns it into exit 130), seconds late where the load was in native code, and, when it came
    as the load's worker threads were in native code, the interpreter's exit aborted the
    process ("terminate called without an active exception", SIGABRT). Nothing is held that
    needs a clean-up yet, so the process ends without the interpreter's exit. A signal ignored
    at start (a background job's SIGINT) stays ignored; off the main thread nothing is changed.
    ``say``: where the line goes (default: stderr)."""
    import os
    import signal
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in signals}

    def on_signal(signum: int, frame: Any) -> None:
        line = f"interrupted ({signal.Signals(signum).name}) {what}: exiting"
        with contextlib.suppress(Exception):  # NOTE: the exit must not depend on the line
            sys.stdout.flush()
            if say is None:
                typer.secho(line, fg="red", err=True)
            else:
                say(line)
            sys.stderr.flush()
        os._exit(128 + signum)

    for s in signals:
        if before[s] is not signal.SIG_IGN:
            signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
