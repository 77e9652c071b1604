"""The ``coda`` command: serve, generate, bench, models, trace check.

``--model`` takes an HF folder, a ``.gguf`` file, or an installed package that ships one
(``coda/models/source.py``). A model that cannot be loaded ends the command with its message
and exit status 2, never a stack trace.

This module declares the typer app and every command's options; each command's body lives in
``coda/commands/`` and is imported when the command runs (``import coda.cli`` stays cheap:
``coda --help`` and a bad flag cost no server or torch import).
"""

from __future__ import annotations

import inspect
import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer

from coda.commands.serve_checks import LOG_LEVELS

F = TypeVar("F", bound=Callable[..., Any])


def _unwrapped(fn: F) -> F:
    """A command's docstring as its help: each paragraph's source lines joined into one line.
    Typer's rich help keeps a docstring's single line breaks (in ``coda --help``'s command
    list and in the paragraphs after the first), which cut sentences at the source's width
    rather than the terminal's; joined, the terminal wraps them. Click's ``\\b`` marker is
    the opposite (keep these breaks), so it is no help here."""
    paragraphs = inspect.cleandoc(fn.__doc__ or "").split("\n\n")
    fn.__doc__ = "\n\n".join(" ".join(p.split()) for p in paragraphs)
    return fn


app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Coda: an LLM inference server with exact decoding, streaming and termination.")
trace_app = typer.Typer(help="Work with JSONL request traces.")
app.add_typer(trace_app, name="trace")


def _print_version(value: bool) -> None:
    """``coda --version``: the installed distribution's version, then exit 0 (what ``pip``,
    ``ollama`` and ``llama-server`` users type first); the source tree's when not installed."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        typer.echo(f"coda {version('coda-llm')}")
    except PackageNotFoundError:
        typer.echo("coda (not installed: run from a source tree)")
    raise typer.Exit()


@contextmanager
def _reader_may_leave() -> Iterator[list[int]]:
    """A command whose reader left (``coda models | head -1``) ends quietly with exit 0, as
    ``generate`` does (tests/test_cli_pipe.py). Click would turn the BrokenPipeError into exit
    1; flushing inside makes the last write fail here, not at the interpreter's exit. A stdout
    that cannot take the output (``> /dev/full``) is generate's one error line and exit 1 (it
    was a traceback). What it yields holds the status a reader's leaving exits with (0; a
    verdict already reached, trace check's problems, sets its own). The commands wrapped turn
    their own input's OSErrors into a usage error (exit 2) themselves, so an OSError reaching
    here is stdout's."""
    from coda.commands.generate import say_write_error, stdout_to_devnull

    left = [0]
    try:
        yield left
        sys.stdout.flush()
    except BrokenPipeError:
        # NOTE: stdout points at /dev/null so the interpreter's final flush cannot raise again
        stdout_to_devnull()
        raise typer.Exit(left[0]) from None
    except OSError as exc:
        stdout_to_devnull()
        say_write_error(exc)
        raise typer.Exit(1) from None


@app.callback()
def _main(show_version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version, help="print the version and exit")] = False) -> None:
    """Coda: an LLM inference server with exact decoding, streaming and termination."""
    # NOTE: a stdout whose encoding lacks a character (models' arrow, bench's dash, a path's)
    # shows an escape, not a UnicodeEncodeError traceback (PYTHONIOENCODING=ascii, a Latin-1
    # locale); generate writes the stream's bytes themselves (coda.commands.generate.write_out)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def _memory_budget(value: str | None) -> str | None:
    """Every ``--memory-budget`` (serve's several-models one and generate's/bench's one-model
    one) is read by the one parser, ``MemoryBudget.parse`` (8GiB, 8G = 10^9, 512MiB, bytes or
    40% of the memory available now); anything else is a usage error naming the option (exit
    2) before any work. The text is kept: a percentage is taken of what is available when the
    model loads."""
    if value is None:
        return None
    from coda.engine.kv_budget import MemoryBudget, MemoryBudgetError

    try:
        MemoryBudget.parse(value)
    except MemoryBudgetError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf file or installed package shipping one (default: the embedded model)")]  # noqa: UP045
MaxLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", min=1, help="the context length (tokens): caps the model's own, never raises it (a larger one is capped, with a warning at start); past a LongRoPE model's original length it serves the long factors")]  # noqa: UP045
KvBytesOpt = Annotated[Optional[int], typer.Option("--kv-cache-bytes", help="KV cache size in bytes, exactly (default: see --memory-budget)")]  # noqa: UP045
KvFracOpt = Annotated[Optional[float], typer.Option("--kv-cache-fraction", help="KV cache as a fraction of the memory free after the weights (default: see --memory-budget)")]  # noqa: UP045
MemBudgetOpt = Annotated[Optional[str], typer.Option("--memory-budget", callback=_memory_budget, help="memory the model may hold, weights + KV cache: 8GiB, 8G, 512MiB, bytes or 40% of available; the KV cache is max-num-seqs full contexts within it, committed as used (default: half the memory available at start)")]  # noqa: UP045
QuantOpt = Annotated[str, typer.Option("--quant", help="serving mode: auto (GGUF: packed, the fastest batch-invariant mode that keeps the exact model's answers; HF folder: fp32-kernel), fp32 (exact), fp32-kernel (exact, batch-invariant kernel), bf16, fp16, packed (exact weights, own kernel), packed-q8 (8-bit activations like llama.cpp), q4, q4-int8head (docs/quantization.md)")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="a dense mode by its dtype: float32 = --quant fp32, bfloat16 = bf16, float16 = fp16")]  # noqa: UP045
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", min=1, help="torch intra-op threads (default: CPUs - 1)")]  # noqa: UP045


@app.command()
@_unwrapped
def serve(model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="HF folder, .gguf file or installed package shipping one (default: the embedded model); repeat it to serve several models, each as SPEC or NAME=SPEC")] = None,  # noqa: UP045
          models_file: Annotated[Optional[Path], typer.Option(help="a TOML file of [\\[model]] tables (name, model, pinned) to serve besides --model (docs/api.md)")] = None,  # noqa: UP045
          memory_budget: Annotated[Optional[str], typer.Option(callback=_memory_budget, help="several models: weights + KV cache of the loaded models stay under this (8GiB, 8G, 512MiB, bytes or 40% of available); least recently used idle models are unloaded to make room; with --draft-model (one model): that model's weights + KV cache and the draft's weights + KV cache stay under this")] = None,  # noqa: UP045
          pin: Annotated[Optional[list[str]], typer.Option(help="several models: load this model (NAME) at start and never unload it (repeatable)")] = None,  # noqa: UP045
          host: Annotated[str, typer.Option(help="bind address (loopback by default)")] = "127.0.0.1",
          port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
          api_key: Annotated[Optional[str], typer.Option(help="require this bearer key")] = None,  # noqa: UP045
          quant: QuantOpt = "auto",
          dtype: DtypeOpt = None,
          max_num_seqs: Annotated[int, typer.Option(min=1)] = 64,
          served_model_name: Annotated[Optional[str], typer.Option()] = None,  # noqa: UP045
          trace: Annotated[Optional[Path], typer.Option(help="write a JSONL trace of every request")] = None,  # noqa: UP045
          max_body_bytes: Annotated[int, typer.Option(min=1, help="larger request bodies get 413, unparsed")] = 16 * 1024 * 1024,
          max_waiting: Annotated[int, typer.Option(min=-1, help="requests allowed to wait for a slot, at least 1; past it 429 + Retry-After (-1: unbounded)")] = 1024,
          recent_traces: Annotated[int, typer.Option(min=0, help="keep the trace of this many recent requests in memory for the playground (0: off)")] = 64,
          redis_url: Annotated[Optional[str], typer.Option(help="durable stream log on Redis Streams (docs/scale-out.md)")] = None,  # noqa: UP045
          log_retention_s: Annotated[float, typer.Option(help="keep a finished request's log this long")] = 600.0,
          lease_ttl_s: Annotated[float, typer.Option(help="a silent server's requests are ended after this")] = 10.0,
          replicas: Annotated[int, typer.Option(min=0, help="engine replicas on Ray Serve (0: one in-process engine)")] = 0,
          ray_address: Annotated[Optional[str], typer.Option(help="join this Ray cluster (default: start a local one)")] = None,  # noqa: UP045
          replica_cpus: Annotated[float, typer.Option(help="Ray CPUs (and torch threads) per replica")] = 1.0,
          log_level: Annotated[str, typer.Option(help=f"one of {', '.join(LOG_LEVELS)}")] = "info",
          max_model_len: MaxLenOpt = None,
          kv_cache_bytes: KvBytesOpt = None,
          kv_cache_fraction: KvFracOpt = None,
          threads: ThreadsOpt = None,
          speculative: Annotated[str, typer.Option(help="speculative decoding: off, draft (needs --draft-model), or prompt-lookup (drafts from each request's own prompt and output, verified in the same step; the output is exactly plain decoding's; needs a batch-invariant --quant; docs/speculative.md)")] = "off",
          draft_model: Annotated[Optional[str], typer.Option(help="speculative decoding with this draft model (anything --model takes; it must share the model's tokenizer; implies --speculative draft; docs/speculative.md)")] = None) -> None:  # noqa: UP045
    """Serve the HTTP APIs: OpenAI (Chat Completions, Completions, Responses), Anthropic
    (Messages) and Ollama (/api/chat, /api/generate, ...), and the playground at /."""
    from coda.commands.serve import ServeArgs, run_serve

    run_serve(ServeArgs(
        model=tuple(model or ()), models_file=models_file, memory_budget=memory_budget,
        pin=tuple(pin or ()), host=host, port=port, api_key=api_key, quant=quant, dtype=dtype,
        max_num_seqs=max_num_seqs, served_model_name=served_model_name, trace=trace,
        max_body_bytes=max_body_bytes, max_waiting=max_waiting, recent_traces=recent_traces,
        redis_url=redis_url, log_retention_s=log_retention_s, lease_ttl_s=lease_ttl_s,
        replicas=replicas, ray_address=ray_address, replica_cpus=replica_cpus,
        log_level=log_level, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
        kv_cache_fraction=kv_cache_fraction, threads=threads, speculative=speculative,
        draft_model=draft_model))


@app.command()
@_unwrapped
def generate(prompt: Annotated[str, typer.Argument(help="the prompt; - reads it from stdin (UTF-8)")],
             model: ModelOpt = None,
             # NOTE: None is the HTTP APIs' omitted limit, planned by the engine (coda/engine/plan.py)
             max_tokens: Annotated[Optional[int], typer.Option(min=1, help="output token limit; past the context it is refused (default: as the HTTP APIs with it omitted: the engine's default_max_tokens, 256, or up to the context where that comes first, finish_reason context_limit)")] = None,  # noqa: UP045
             temperature: Annotated[float, typer.Option(help="0: greedy (argmax)")] = 0.8,
             top_p: Annotated[float, typer.Option(help="nucleus sampling: keep the most likely tokens up to this mass, in (0, 1]")] = 0.95,
             # NOTE: checked as the HTTP APIs' top_k (SamplingParams): -1 or 0 off, else >= 1
             top_k: Annotated[int, typer.Option(help="keep the k most likely tokens (0 or -1: off; 1: greedy)")] = 0,
             # NOTE: the HTTP APIs' int64 bound (coda.server.schemas.SEED_MIN/MAX, not imported:
             # it pulls in the server); the engine wraps seeds to 64 bits, so 2**64 + 1 seeded as 1
             seed: Annotated[Optional[int], typer.Option(min=-(2 ** 63), max=2 ** 63 - 1, help="the same seed gives the same output (default: a fresh one each run)")] = None,  # noqa: UP045
             stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,  # noqa: UP045
             chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
             deadline: Annotated[Optional[float], typer.Option(help="seconds from the submit; past it the request ends, finish_reason deadline_exceeded")] = None,  # noqa: UP045
             quant: QuantOpt = "auto",
             dtype: DtypeOpt = None,
             max_model_len: MaxLenOpt = None,
             kv_cache_bytes: KvBytesOpt = None,
             kv_cache_fraction: KvFracOpt = None,
             memory_budget: MemBudgetOpt = None,
             threads: ThreadsOpt = None) -> None:
    """Stream one completion to the terminal, then its finish reason, usage and timings."""
    from coda.commands.generate import GenerateArgs, run_generate

    raise typer.Exit(run_generate(GenerateArgs(
        prompt=prompt, model=model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, seed=seed, stop=tuple(stop or ()), chat=chat, deadline=deadline, quant=quant,
        dtype=dtype, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
        kv_cache_fraction=kv_cache_fraction, memory_budget=memory_budget, threads=threads)))


@app.command()
@_unwrapped
def bench(model: ModelOpt = None,
          num_requests: Annotated[int, typer.Option("--num-requests", "-n", min=1, help="requests to run")] = 64,
          concurrency: Annotated[int, typer.Option(min=1, help="most requests in flight at once (capped by --num-requests)")] = 32,
          max_tokens: Annotated[int, typer.Option(min=1, help="output tokens of every request (EOS ignored)")] = 64,
          quant: QuantOpt = "auto",
          dtype: DtypeOpt = None,
          compare_hf: Annotated[bool, typer.Option("--compare-hf", help="also run transformers.generate")] = False,
          early_stop: Annotated[bool, typer.Option("--early-stop", help="compare with/without an early-stop policy")] = False,
          plot: Annotated[Optional[Path], typer.Option(help="write a PNG of the latency distributions")] = None,  # noqa: UP045
          utf8_tail: Annotated[str, typer.Option(help="K3 tail policy of every request: auto (a partial last character cut by max_tokens/the context is removed and recorded; other ends with one fail) | fail (always FAILED) | drop (always removed)")] = "auto",
          seed: int = 0,
          max_model_len: MaxLenOpt = None,
          kv_cache_bytes: KvBytesOpt = None,
          kv_cache_fraction: KvFracOpt = None,
          memory_budget: MemBudgetOpt = None,
          threads: ThreadsOpt = None) -> None:
    """Run a workload; print throughput, TTFT and inter-token latency percentiles."""
    from coda.commands.tools import run_bench_command

    run_bench_command(model_dir=model, num_requests=num_requests, concurrency=concurrency,
                      max_tokens=max_tokens, quant=quant, dtype=dtype, compare_hf=compare_hf,
                      early_stop=early_stop, plot=plot, seed=seed, utf8_tail=utf8_tail,
                      max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                      kv_cache_memory_fraction=kv_cache_fraction, memory_budget=memory_budget,
                      num_threads=threads)


@app.command()
@_unwrapped
def models(paths: Annotated[Optional[list[str]], typer.Argument(help="more folders, .gguf files or packages")] = None) -> None:  # noqa: UP045
    """List loadable models and the serving modes each loads in.

    The embedded model, installed packages with .gguf files, and PATHS, each with its serving
    modes (the first is what --quant auto picks). Exit status 2 when a PATH cannot be read."""
    from coda.commands.tools import show_models

    with _reader_may_leave():
        show_models(list(paths or []))


@trace_app.command("check")
@_unwrapped
def trace_check(path: Path) -> None:
    """Verify a JSONL trace: every row in its place and the usage equal to what rows count.

    Checked: lifecycle, steps, cancel moments, resources, and the terminal's usage; each
    problem names its rule (coda/trace_check.py). Exit status 1 on a problem, 2 for an
    unreadable file. A cut last line (a server killed mid-row) is said on stderr and left out;
    the whole rows are checked. An empty trace (a replica that served no request writes one) holds every
    invariant and says it is empty."""
    from coda.commands.tools import check_trace_file

    with _reader_may_leave() as left:
        check_trace_file(path, left)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
