"""What every model-loading command does first: refuse a bad kernel build, load the engine and
tell what was loaded; a failure is one red line and exit 2, never a stack trace."""

from __future__ import annotations

from typing import Any, NoReturn

import typer


def fail(message: str) -> NoReturn:
    """``error: message`` in red on stderr and exit 2 (a bad argument: before any work)."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2) from None


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

    # NOTE: loading takes seconds to minutes: say what is happening before it starts
    announce = say if say is not None else (lambda line: typer.echo(line, err=True))
    announce(f"loading model {model or '(default)'} ...")
    try:
        engine = AsyncEngine.from_model_dir(model, cfg)
    except (ModelLoadError, ValueError) as exc:
        # NOTE: a draft's failure names the draft and its flag itself, never the target
        what = "" if isinstance(exc, DraftModelLoadError) else \
            f"cannot load model {model or '(default)'}: "
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
