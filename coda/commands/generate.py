"""``coda generate``: one completion streamed to the terminal, then its terminal line, usage and
timings; SIGINT/SIGTERM cancel the request (L4, C1) instead of killing the process."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from coda.commands.loading import (
    engine_config,
    fail,
    interrupt_exits,
    load_engine,
    refuse_bad_isa,
    refuse_two_kv_sizes,
)

if TYPE_CHECKING:
    from coda.finish import Terminal


@dataclass(frozen=True)
class GenerateArgs:
    """``coda generate``'s options as typed (their help: ``coda/cli.py``)."""

    prompt: str
    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    chat: bool
    deadline: float | None
    quant: str
    dtype: str | None
    max_model_len: int | None
    kv_cache_bytes: int | None
    kv_cache_fraction: float | None
    memory_budget: str | None
    threads: int | None


def cancel_on_signals(handle: Any) -> list[int]:
    """SIGINT/SIGTERM cancel ``handle``'s request instead of killing the process, so that an
    interrupted ``coda generate`` still ends with its terminal line (CANCELLED, finish reason
    ``cancelled``, usage: L4, C1) and exits 128 + the signal. The returned list gets the
    signal's number; a second signal is the default one again (it ends the process at once)."""
    import signal

    loop = asyncio.get_running_loop()
    got: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal(signum: int) -> None:
        got.append(signum)
        for s in signals:  # NOTE: removing restores Python's default handling for the next one
            loop.remove_signal_handler(s)
        handle.cancel()

    for s in signals:
        loop.add_signal_handler(s, on_signal, int(s))
    return got


def write_out(data: bytes) -> OSError | None:
    """Write ``data`` to stdout now, as the bytes they are (K1: the stream's UTF-8 whatever the
    locale; a stdout whose text encoding cannot take a character, ``PYTHONIOENCODING=ascii``
    or a Latin-1 locale, was a UnicodeEncodeError traceback, exit 1, the request's end never
    said); the error when it cannot be: :class:`BrokenPipeError` when
    its reader is gone (``coda generate | head``), another :class:`OSError` for a stdout that
    cannot take it (a full disk, a closed descriptor). stdout then goes to /dev/null, so
    nothing later (the interpreter's last flush included) raises on it. A reader gone was
    click's EPIPE exit (status 1, the request left to the shutdown); a write error was a
    traceback, exit 1, and the request's end never said."""
    import errno

    if sys.stdout is None:
        # NOTE: the interpreter started with fd 1 closed (``>&-``): fd 1 may since be another
        # file of this process (the event loop's), so it is left alone
        return OSError(errno.EBADF, "stdout is closed")
    try:
        sys.stdout.flush()  # NOTE: nothing written as text may follow the bytes
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except OSError as exc:
        stdout_to_devnull()
        return exc
    return None


def stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null once a write to it failed, so that nothing later (the
    interpreter's last flush included) raises on it again."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def say_write_error(exc: OSError) -> None:
    """The one line every command says when stdout cannot take its output (a full disk, a
    closed descriptor), as GNU tools' "write error"; the command then exits 1."""
    typer.secho(f"error: cannot write the output to stdout: {exc.strerror or exc}", fg="red",
                err=True)


def print_terminal(t: Terminal) -> None:
    """The request's end on stderr: state and finish reason, any error, usage and timings."""
    stop_s = f" (stop {t.stop.stop!r})" if t.stop is not None else ""
    typer.secho(f"[{t.state.value} · finish_reason={t.finish_reason.value}{stop_s}]",
                fg=typer.colors.CYAN, err=True)
    if t.error_message:
        typer.secho(f"error: {t.error_code} {t.error_message}", fg="red", err=True)
    typer.echo(f"usage: {json.dumps(t.usage.to_dict())}", err=True)
    ttft = f"{t.first_token_s * 1000:.1f}" if t.first_token_s is not None else "-"
    typer.echo(f"timings: queue {t.queue_s * 1000:.1f} ms · prefill "
               f"{t.prefill_s * 1000:.1f} ms · decode {t.decode_s * 1000:.1f} ms · "
               f"stop-buffer {t.stop_buffer_s * 1000:.1f} ms · ttft {ttft} ms · "
               f"{t.usage.selected_tokens / max(t.decode_s, 1e-9):.1f} tok/s",
               err=True)


def flag_error(exc: Any, flag: str) -> str:
    """A refused value's line under the flag that gave it: ``invalid_request: --stop: ...``. The
    engine's message may open with its own field's label (``stop: ...``, as the HTTP APIs say
    it); that label is dropped for the flag's, not said twice."""
    message: str = exc.message
    if exc.field and message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2:]
    return f"{exc.code.value}: {flag}: {message}"


def read_prompt(arg: str) -> str:
    """The prompt ``arg`` names: itself, or for ``-`` stdin's bytes, whole (a prompt past
    argv's 128 KiB, a file's exact text: ``coda generate - < prompt.txt``; the bytes are
    UTF-8 whatever the locale, as the output is); text that is no UTF-8 is exit 2, before the
    model loads. Before, ``-`` was the prompt itself and ``echo hi | coda generate`` a missing
    argument."""
    if arg == "-":
        if sys.stdin is None:  # NOTE: started with fd 0 closed (``<&-``)
            fail("cannot read the prompt from stdin: stdin is closed")
        try:
            return sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError:
            fail("the prompt read from stdin is not valid UTF-8 text")
        except OSError as exc:
            fail(f"cannot read the prompt from stdin: {exc.strerror or exc}")
    try:  # NOTE: argv bytes that are no UTF-8 arrive as lone surrogates, which no tokenizer takes
        arg.encode("utf-8")
    except UnicodeEncodeError:
        fail("the prompt is not valid UTF-8 text")
    return arg


def run_generate(args: GenerateArgs) -> int:
    """Load, generate and print; the exit status: 0 finished, 1 otherwise, 128 + the signal
    when interrupted, 2 for a refused value (before the model loads where it can be)."""
    from coda.engine.types import GenerationRequest
    from coda.errors import CodaError
    from coda.sampling import SamplingParams

    refuse_bad_isa()
    refuse_two_kv_sizes(args.kv_cache_bytes, args.kv_cache_fraction, args.memory_budget)
    try:  # NOTE: bad sampling flags are refused before the model loads: a message and exit 2
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed)
    except CodaError as exc:
        fail(f"{exc.code.value}: {exc.message}")
    from coda.engine.plan import check_stop_strings

    try:  # NOTE: the stop strings' own rules need no model (S1): an empty --stop is exit 2 at once
        check_stop_strings(args.stop)
    except CodaError as exc:
        fail(flag_error(exc, "--stop"))
    prompt = read_prompt(args.prompt)
    if args.deadline is not None and not args.deadline > 0:  # NOTE: as plan_request's G3 check, before the load
        fail(f"--deadline must be > 0 seconds, got {args.deadline}")
    # NOTE: a Ctrl-C before the request runs (the load above all): one line, exit 130 at once;
    # once it runs, cancel_on_signals' cancel takes over
    with interrupt_exits("before the request started (nothing generated)"):
        engine = load_engine(args.model, engine_config(
            quant=args.quant, dtype=args.dtype, max_num_seqs=4, max_model_len=args.max_model_len,
            kv_cache_bytes=args.kv_cache_bytes, kv_cache_memory_fraction=args.kv_cache_fraction,
            memory_budget=args.memory_budget, num_threads=args.threads))
        text = prompt
        if args.chat:
            from coda.server.chat import render_chat

            text = render_chat(engine, [{"role": "user", "content": prompt}])
        # NOTE: a raw prompt gets the model's special tokens (its BOS, once), as
        # /v1/completions does; a rendered chat template already holds them
        ids = (engine.tokenizer.encode(text, add_special_tokens=False).ids if args.chat
               else engine.chat.encode_prompt(text))
        req = GenerationRequest(tuple(ids), params, max_tokens=args.max_tokens, stop=args.stop,
                                deadline_s=args.deadline)

        async def run() -> int:
            handle = engine.submit(req)
            interrupted = cancel_on_signals(handle)
            failed: OSError | None = None  # NOTE: the first write that failed
            async for ev in handle.events():
                if ev.data and failed is None and (failed := write_out(ev.data)) is not None:
                    handle.cancel()  # NOTE: nothing more can be shown; its end is awaited
                if ev.terminal is not None:
                    if failed is None:
                        failed = write_out(b"\n")
                    if isinstance(failed, BrokenPipeError):
                        # NOTE: as a Unix tool whose reader left (| head): nothing said, exit 0
                        return 0
                    if failed is not None:  # NOTE: as GNU tools' "write error": exit 1
                        say_write_error(failed)
                    print_terminal(ev.terminal)
                    if interrupted:  # NOTE: the shell's convention: 128 + the signal's number
                        return 128 + interrupted[0]
                    return 0 if failed is None and ev.terminal.state.value == "FINISHED" else 1
            return 1

        with engine:
            try:
                return asyncio.run(run())
            except CodaError as exc:  # NOTE: a refused request is a message and exit 2, not a trace
                typer.secho(f"error: {exc.code.value}: {exc.message}", fg="red", err=True)
                return 2
