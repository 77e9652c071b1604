"""The ``coda`` command: serve, generate, bench, models, trace check.

``--model`` takes an HF folder, a ``.gguf`` file, or an installed package that ships one
(``coda/models/source.py``). A model that cannot be loaded ends the command with its message
and exit status 2, never a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Coda: an LLM inference server with exact decoding, streaming and termination.")
trace_app = typer.Typer(help="Work with JSONL request traces.")
app.add_typer(trace_app, name="trace")

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf file or installed package shipping one (default: the embedded model)")]  # noqa: UP045
MaxLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="the context length (tokens): caps it; past a LongRoPE model's original length it serves the long factors")]  # noqa: UP045
KvBytesOpt = Annotated[Optional[int], typer.Option("--kv-cache-bytes", help="KV cache size in bytes, exactly (default: see --memory-budget)")]  # noqa: UP045
KvFracOpt = Annotated[Optional[float], typer.Option("--kv-cache-fraction", help="KV cache as a fraction of the memory free after the weights (default: see --memory-budget)")]  # noqa: UP045
MemBudgetOpt = Annotated[Optional[str], typer.Option("--memory-budget", help="memory the model may hold, weights + KV cache: 8GiB, 8G, 512MiB, bytes or 40%% of available; the KV cache is max-num-seqs full contexts within it, committed as used (default: half the memory available at start)")]  # noqa: UP045
QuantOpt = Annotated[str, typer.Option("--quant", help="serving mode: auto (GGUF: packed, the fastest batch-invariant mode that keeps the exact model's answers; HF folder: fp32-kernel), fp32 (exact), fp32-kernel (exact, batch-invariant kernel), bf16, fp16, packed (exact weights, own kernel), packed-q8 (8-bit activations like llama.cpp), q4, q4-int8head (docs/quantization.md)")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="a dense mode by its dtype: float32 = --quant fp32, bfloat16 = bf16, float16 = fp16")]  # noqa: UP045
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", min=1, help="torch intra-op threads (default: CPUs - 1)")]  # noqa: UP045


def _load(model: str | None, cfg: Any, say: Any = None) -> Any:
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
        typer.secho(f"error: {what}{exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    if say is None:
        for line in engine.describe():
            typer.echo(line, err=True)
    else:
        for line in engine.describe():
            say(line)
        # O1: one JSON line with what was loaded, the serving mode and its numerics included
        say("model loaded", extra=engine.load_summary())
    return engine


def _refuse_bad_isa() -> None:
    """A ``CODA_KERNEL_ISA`` that names no build this CPU runs: one line and exit 2 before any
    work (it was a silent fallback to the torch path: another mode, other output)."""
    from coda.models.kernels import KernelIsaError, check_isa

    try:
        check_isa()
    except KernelIsaError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None


def _preload_torch_libraries() -> None:
    """Load torch's shared libraries (``libtorch_python`` and what it links: libtorch_cpu,
    c10, gomp) in a background thread, so that the later ``import torch`` finds them loaded.

    Issue 19 item 2: mapping and relocating them is a fifth of ``import torch`` (~0.3 s of CPU),
    and ``ctypes`` releases the GIL for it, so it runs on the second core while this thread
    imports the server (FastAPI, pydantic: ~0.7 s). Loaded ``RTLD_LOCAL`` as torch loads them
    itself; ``import torch`` waits on the loader's lock if it comes first, so nothing else
    changes. Where the file is not found (another layout or platform) nothing is done."""
    import ctypes
    import importlib.util
    import threading

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtorch_python.so"
    if not lib.is_file():
        return

    def load() -> None:
        # NOTE: a failure is import torch's to report, as it always was; ctypes never unloads
        # a library, so the handle may be dropped
        with contextlib.suppress(OSError):
            ctypes.CDLL(str(lib))

    threading.Thread(target=load, name="coda-torch-libs", daemon=True).start()


@contextlib.contextmanager
def _startup_gc() -> Iterator[None]:
    """Start-up with Python's cyclic collector paused (issue 19 item 2).

    Importing torch and FastAPI and building the model allocate some 350k objects, and the
    collector scanned them again and again (five full collections): 0.35-0.5 s of a 2.4 s
    start. Nothing of the start-up needs it (its cyclic garbage is ~7k small objects: typing's
    tuples, cells and functions). On success what start-up built is frozen (the permanent
    generation: never scanned again, as CPython's ``gc.freeze`` is meant for long-lived
    start-up state), then the collector runs as before for everything made later; on failure
    it is only resumed."""
    import gc

    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    except BaseException:
        gc.enable()
        raise
    gc.freeze()
    gc.enable()


def _unwritable(path: Path) -> str | None:
    """Why a file cannot be appended to (``--trace``), or None: said before any work, as a busy
    port is, not as a traceback once the model has loaded. Nothing is created here (with
    ``--replicas`` each replica writes its own file beside it)."""
    import os

    if path.is_dir():
        return "is a directory"
    parent = path.absolute().parent
    if not parent.is_dir():
        return f"the folder {parent} does not exist"
    target = path if path.exists() else parent
    return None if os.access(target, os.W_OK) else f"{target} is not writable"


def _load_router(models: list[str], models_file: Path | None, pins: list[str],
                 memory_budget: str | None, cfg: Any, log_level: str) -> Any:
    """Several models (issue 23): each described now (names, tokenizer, context; no weights),
    loaded in its own worker process on first use. Bad specs exit 2 with the message."""
    from coda.models.config import ModelLoadError
    from coda.server.model_router import build_router
    from coda.server.model_specs import ModelSpecError, collect_specs, parse_bytes

    try:
        specs = collect_specs(models, models_file, pins)
        budget = parse_bytes(memory_budget) if memory_budget is not None else None
        return build_router(specs, cfg, memory_budget=budget, log_level=log_level)
    except (ModelSpecError, ModelLoadError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None


@app.command()
def serve(model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="HF folder, .gguf file or installed package shipping one (default: the embedded model); repeat it to serve several models, each as SPEC or NAME=SPEC")] = None,  # noqa: UP045
          models_file: Annotated[Optional[Path], typer.Option(help="a TOML file of [[model]] tables (name, model, pinned) to serve besides --model (docs/api.md)")] = None,  # noqa: UP045
          memory_budget: Annotated[Optional[str], typer.Option(help="several models: weights + KV cache of the loaded models stay under this (bytes, or 4GiB); least recently used idle models are unloaded to make room")] = None,  # noqa: UP045
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
          replicas: Annotated[int, typer.Option(help="engine replicas on Ray Serve (0: one in-process engine)")] = 0,
          ray_address: Annotated[Optional[str], typer.Option(help="join this Ray cluster (default: start a local one)")] = None,  # noqa: UP045
          replica_cpus: Annotated[float, typer.Option(help="Ray CPUs (and torch threads) per replica")] = 1.0,
          log_level: Annotated[str, typer.Option(help=f"one of {', '.join(LOG_LEVELS)}")] = "info",
          max_model_len: MaxLenOpt = None,
          kv_cache_bytes: KvBytesOpt = None,
          kv_cache_fraction: KvFracOpt = None,
          threads: ThreadsOpt = None,
          speculative: Annotated[str, typer.Option(help="speculative decoding: off, draft (needs --draft-model), or prompt-lookup (drafts from each request's own prompt and output, verified in the same step; the output is exactly plain decoding's; needs a batch-invariant --quant; docs/speculative.md)")] = "off",
          draft_model: Annotated[Optional[str], typer.Option(help="speculative decoding with this draft model (anything --model takes; it must share the model's tokenizer; implies --speculative draft; docs/speculative.md)")] = None) -> None:  # noqa: UP045
    """Serve the OpenAI- and Anthropic-compatible HTTP API and the playground at /."""
    if log_level.lower() not in LOG_LEVELS:  # NOTE: uvicorn's levels; others were a traceback
        typer.secho(f"error: --log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}",
                    fg="red", err=True)
        raise typer.Exit(2)
    if max_waiting == 0:  # NOTE: every request waits for a step to admit it: 0 refuses them all
        typer.secho("error: --max-waiting 0 would refuse every request (each one waits until the "
                    "next step admits it); use 1 or more, or -1 for unbounded", fg="red", err=True)
        raise typer.Exit(2)
    _refuse_bad_isa()
    with _startup_gc():
        # NOTE: first: it runs beside the checks, the bind and the server's imports below
        if replicas == 0:
            _preload_torch_libraries()
        from coda.engine.types import EngineConfig
        from coda.optional import MissingDependency, require
        from coda.server.listen import ListenError, bind_listener

        # NOTE: the extras first (issue 24 item 5): one message naming them, before any work
        try:
            require(*(["replicas"] if replicas > 0 or ray_address else []),
                    *(["redis"] if redis_url else []))
        except MissingDependency as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        if trace is not None and (why := _unwritable(trace)) is not None:
            typer.secho(f"error: --trace {trace}: {why}", fg="red", err=True)
            raise typer.Exit(2)
        # NOTE: the port first: a busy port is said in a second, not after the model loaded
        try:
            sock = bind_listener(host, port)
        except ListenError as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        from coda.server.app import serve as run_server
        from coda.server.logs import configure_logging
        from coda.server.model_specs import parse_model_arg
        from coda.server.state import ServerSettings

        cfg = EngineConfig(quant=quant, dtype=dtype, max_num_seqs=max_num_seqs,
                           served_model_name=served_model_name,
                           trace_path=str(trace) if trace else None, max_model_len=max_model_len,
                           kv_cache_bytes=kv_cache_bytes, kv_cache_memory_fraction=kv_cache_fraction,
                           num_threads=threads, recent_traces=recent_traces,
                           speculative=speculative, draft_model=draft_model)
        # NOTE: serve's --memory-budget is the several-models router's (one model included): it
        # gives each model its share (weights + KV); without it one model takes the default budget
        # NOTE: the server's stderr is JSON lines only (O1): what was loaded is logged, not echoed
        configure_logging(log_level)
        several = len(model or []) > 1 or models_file is not None or memory_budget or pin
        if several and (replicas > 0 or served_model_name or redis_url):
            # NOTE: a replica serves one model; names come from NAME=SPEC, not one flag; the
            # durable log's engine wrapper does not route by model (not built yet)
            typer.secho("error: several models (--model repeated, --models-file, --memory-budget, "
                        "--pin) are not supported with --replicas, --redis-url or "
                        "--served-model-name (name each model as --model NAME=SPEC)",
                        fg="red", err=True)
            raise typer.Exit(2)
        if several and draft_model:  # NOTE: a draft must share ONE target's tokenizer (issue 21)
            typer.secho("error: --draft-model drafts for one model; it is not supported with "
                        "several models", fg="red", err=True)
            raise typer.Exit(2)
        # NOTE: one --model is SPEC or NAME=SPEC as with several (NAME: the served name)
        one = parse_model_arg(model[0]) if model and not several else None
        if one is not None and one.name is not None:
            if served_model_name is not None and served_model_name != one.name:
                typer.secho(f"error: --model {model[0]} names the model {one.name!r} and "
                            f"--served-model-name {served_model_name!r}: give one",
                            fg="red", err=True)
                raise typer.Exit(2)
            cfg = replace(cfg, served_model_name=one.name)
        durable = None
        if redis_url:
            from coda.server.durable import ServerDurable

            durable = ServerDurable(redis_url, retention_s=log_retention_s, lease_ttl_s=lease_ttl_s)
        if several:
            engine: Any = _load_router(list(model or []), models_file, list(pin or []),
                                       memory_budget, cfg, log_level)
        elif replicas > 0:
            # NOTE: Ray is imported only here (issue 12: nothing of Ray without --replicas)
            from coda.scaleout.deploy import start_replicas, stop_replicas

            # NOTE: with a log the replicas write it themselves (chosen here, once)
            engine = start_replicas(replicas, one.model if one else None, cfg,
                                    ray_address=ray_address, num_cpus=replica_cpus,
                                    torch_threads=max(1, int(replica_cpus)),
                                    log=durable.log if durable is not None else None)
        else:
            engine = _load(one.model if one else None, cfg, logging.getLogger("coda.server").info)
    settings = ServerSettings(max_body_bytes=max_body_bytes,
                              max_waiting=None if max_waiting < 0 else max_waiting)
    try:
        run_server(engine, host=host, port=port, api_key=api_key, log_level=log_level,
                   settings=settings, durable=durable, sock=sock)
    finally:
        if replicas > 0:
            stop_replicas(engine)


def _cancel_on_signals(handle: Any) -> list[int]:
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


@app.command()
def generate(prompt: str,
             model: ModelOpt = None,
             # NOTE: None is the HTTP APIs' omitted limit, planned by the engine (coda/engine/plan.py)
             max_tokens: Annotated[Optional[int], typer.Option(min=1, help="output token limit; past the context it is refused (default: as the HTTP APIs with it omitted: 256, EngineConfig.default_max_tokens, or up to the context where that comes first, finish_reason context_limit)")] = None,  # noqa: UP045
             temperature: float = 0.8,
             top_p: float = 0.95,
             # NOTE: the HTTP APIs' int64 bound (coda.server.schemas.SEED_MIN/MAX, not imported:
             # it pulls in the server); the engine wraps seeds to 64 bits, so 2**64 + 1 seeded as 1
             seed: Annotated[Optional[int], typer.Option(min=-(2 ** 63), max=2 ** 63 - 1)] = None,  # noqa: UP045
             stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,  # noqa: UP045
             chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
             deadline: Annotated[Optional[float], typer.Option(help="seconds")] = None,  # noqa: UP045
             quant: QuantOpt = "auto",
             dtype: DtypeOpt = None,
             max_model_len: MaxLenOpt = None,
             kv_cache_bytes: KvBytesOpt = None,
             kv_cache_fraction: KvFracOpt = None,
             memory_budget: MemBudgetOpt = None,
             threads: ThreadsOpt = None) -> None:
    """Stream one completion to the terminal, then its finish reason, usage and timings."""
    from coda.engine.types import EngineConfig, GenerationRequest
    from coda.errors import CodaError
    from coda.sampling import SamplingParams

    _refuse_bad_isa()
    try:  # NOTE: bad sampling flags are refused before the model loads: a message and exit 2
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    except CodaError as exc:
        typer.secho(f"error: {exc.code.value}: {exc.message}", fg="red", err=True)
        raise typer.Exit(2) from None
    if deadline is not None and not deadline > 0:  # NOTE: as plan_request's G3 check, before the load
        typer.secho(f"error: --deadline must be > 0 seconds, got {deadline}", fg="red", err=True)
        raise typer.Exit(2)
    engine = _load(model, EngineConfig(quant=quant, dtype=dtype, max_num_seqs=4, max_model_len=max_model_len,
                                       kv_cache_bytes=kv_cache_bytes,
                                       kv_cache_memory_fraction=kv_cache_fraction,
                                       memory_budget=memory_budget, num_threads=threads))
    text = prompt
    if chat:
        from coda.server.chat import render_chat

        text = render_chat(engine, [{"role": "user", "content": prompt}])
    # NOTE: a raw prompt gets the model's special tokens (its BOS), as /v1/completions does;
    # a rendered chat template already holds them
    ids = engine.tokenizer.encode(text, add_special_tokens=not chat).ids
    req = GenerationRequest(tuple(ids), params, max_tokens=max_tokens, stop=tuple(stop or ()),
                            deadline_s=deadline)

    async def run() -> int:
        handle = engine.submit(req)
        interrupted = _cancel_on_signals(handle)
        async for ev in handle.events():
            if ev.data:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            if ev.terminal is not None:
                t = ev.terminal
                sys.stdout.write("\n")
                stop_s = f" (stop {t.stop.stop!r})" if t.stop is not None else ""
                typer.secho(f"[{t.state.value} · finish_reason={t.finish_reason.value}{stop_s}]",
                            fg=typer.colors.CYAN, err=True)
                if t.error_message:
                    typer.secho(f"error: {t.error_code} {t.error_message}", fg="red", err=True)
                typer.echo(f"usage: {json.dumps(t.usage.to_dict())}", err=True)
                tm = t.timings
                ttft = f"{tm.first_token_s * 1000:.1f}" if tm.first_token_s is not None else "-"
                typer.echo(f"timings: queue {tm.queue_s * 1000:.1f} ms · prefill "
                           f"{tm.prefill_s * 1000:.1f} ms · decode {tm.decode_s * 1000:.1f} ms · "
                           f"stop-buffer {tm.stop_buffer_s * 1000:.1f} ms · ttft {ttft} ms · "
                           f"{t.usage.selected_tokens / max(tm.decode_s, 1e-9):.1f} tok/s",
                           err=True)
                if interrupted:  # NOTE: the shell's convention: 128 + the signal's number
                    return 128 + interrupted[0]
                return 0 if t.state.value == "FINISHED" else 1
        return 1

    with engine:
        try:
            code = asyncio.run(run())
        except CodaError as exc:  # NOTE: a refused request is a message and exit 2, not a trace
            typer.secho(f"error: {exc.code.value}: {exc.message}", fg="red", err=True)
            code = 2
    raise typer.Exit(code)


@app.command()
def bench(model: ModelOpt = None,
          num_requests: Annotated[int, typer.Option("--num-requests", "-n", min=1)] = 64,
          concurrency: Annotated[int, typer.Option(min=1)] = 32,
          max_tokens: Annotated[int, typer.Option(min=1)] = 64,
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
    from coda.bench import BenchOptions, run_bench
    from coda.errors import CodaError
    from coda.models.config import ModelLoadError
    from coda.optional import MissingDependency

    _refuse_bad_isa()
    try:  # NOTE: a bad option value (--utf8-tail) is refused before the model loads
        opts = BenchOptions(model_dir=model, num_requests=num_requests,
                            concurrency=concurrency, max_tokens=max_tokens, quant=quant,
                            dtype=dtype,
                            compare_hf=compare_hf, early_stop=early_stop, plot=plot, seed=seed,
                            utf8_tail=utf8_tail, max_model_len=max_model_len,
                            kv_cache_bytes=kv_cache_bytes,
                            kv_cache_memory_fraction=kv_cache_fraction,
                            memory_budget=memory_budget, num_threads=threads)
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    try:
        run_bench(opts)
    except MissingDependency as exc:  # NOTE: raised before any work starts
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    except ModelLoadError as exc:
        typer.secho(f"error: cannot load model {model or '(default)'}: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    except CodaError as exc:  # NOTE: the workload's requests refused (--max-tokens past the context)
        typer.secho(f"error: {exc.code.value}: {exc.message}", fg="red", err=True)
        raise typer.Exit(2) from None


@app.command()
def models(paths: Annotated[Optional[list[str]], typer.Argument(help="more folders, .gguf files or packages")] = None) -> None:  # noqa: UP045
    """List loadable models: the embedded one, installed packages with .gguf files, and PATHS,
    with the serving modes each loads in (the first is what --quant auto picks); exit 2 when a
    PATH cannot be read."""
    from rich.console import Console
    from rich.table import Table

    from coda.models.catalog import list_models, named_entries

    _refuse_bad_isa()  # NOTE: the modes listed depend on the kernel build
    table = Table("--model", "kind", "arch", "params", "size", "stored as", "context",
                  "--quant (auto → first)", "read", "path")
    notes: list[str] = []
    named = list(paths or [])
    entries = list_models(named)
    for e in entries:
        if e.error:
            table.add_row(e.model, e.kind, f"[red]{e.error}", "", "", "", "", "", "", str(e.path))
            continue
        others = [m for m in e.quant_modes if m != e.quant_auto]
        table.add_row(e.model, e.kind, e.arch, f"{e.parameters / 1e6:.1f}M",
                      f"{e.size_bytes / 2**20:.1f} MiB", e.quantization, str(e.context),
                      " ".join([e.quant_auto, *others]), f"{e.read_s:.2f} s", str(e.path))
        # NOTE: why, below the table (issue 19 item 5): auto's choice, then each refusal
        notes.append(f"{e.model}: auto serves {e.why}")
        notes += [f"{e.model}: --quant {m} would not load: {why}" for m, why in e.refused]
    console = Console(width=max(Console().width, 160))  # NOTE: paths stay readable in pipes
    console.print(table)
    for line in notes:
        console.print(line, highlight=False, markup=False)
    if failed := [e.model for e in named_entries(entries, named) if e.error]:
        typer.secho(f"error: cannot read {', '.join(failed)} (its row says why)", fg="red",
                    err=True)
        raise typer.Exit(2)


@trace_app.command("check")
def trace_check(path: Path) -> None:
    """Verify a JSONL trace: every row in its place (lifecycle, steps, cancel moments,
    resources) and the terminal's usage equal to what the rows count; each problem names its
    rule (coda/trace_check.py); exit 1 on a problem, 2 for an unreadable file; an empty trace
    (a replica that served no request writes one) holds every invariant and says it is empty."""
    from coda.trace import check_trace, read_jsonl

    try:
        events = read_jsonl(path)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        # NOTE: a missing or non-trace file is a bad argument (exit 2, one line), not a traceback
        typer.secho(f"error: cannot read trace {path}: {type(exc).__name__}: {exc}", fg="red",
                    err=True)
        raise typer.Exit(2) from None
    problems = check_trace(events)
    n = len({e.request_id for e in events})
    if problems:
        for p in problems:
            typer.secho(p, fg="red")
        typer.echo(f"{len(problems)} problem(s) in {n} request(s), {len(events)} events")
        raise typer.Exit(1)
    if not events:  # NOTE: said, so that a wrong path to an empty file is not read as a pass
        typer.echo(f"ok: the trace is empty (0 requests): {path}")
        return
    typer.echo(f"ok: {n} request(s), {len(events)} events, every invariant holds")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
