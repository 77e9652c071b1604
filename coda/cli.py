"""The ``coda`` command: serve, generate, bench, trace check."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Coda: an LLM inference server with exact decoding, streaming and termination.")
trace_app = typer.Typer(help="Work with JSONL request traces.")
app.add_typer(trace_app, name="trace")

ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="HF model folder (default: the embedded model)")]  # noqa: UP045


@app.command()
def serve(model: ModelOpt = None,
          host: Annotated[str, typer.Option(help="bind address (loopback by default)")] = "127.0.0.1",
          port: int = 8000,
          api_key: Annotated[Optional[str], typer.Option(help="require this bearer key")] = None,  # noqa: UP045
          dtype: str = "float32",
          max_num_seqs: int = 64,
          served_model_name: Annotated[Optional[str], typer.Option()] = None,  # noqa: UP045
          trace: Annotated[Optional[Path], typer.Option(help="write a JSONL trace of every request")] = None,  # noqa: UP045
          redis_url: Annotated[Optional[str], typer.Option(help="durable stream log on Redis Streams (docs/scale-out.md)")] = None,  # noqa: UP045
          log_retention_s: Annotated[float, typer.Option(help="keep a finished request's log this long")] = 600.0,
          lease_ttl_s: Annotated[float, typer.Option(help="a silent server's requests are ended after this")] = 10.0,
          replicas: Annotated[int, typer.Option(help="engine replicas on Ray Serve (0: one in-process engine)")] = 0,
          ray_address: Annotated[Optional[str], typer.Option(help="join this Ray cluster (default: start a local one)")] = None,  # noqa: UP045
          replica_cpus: Annotated[float, typer.Option(help="Ray CPUs (and torch threads) per replica")] = 1.0,
          log_level: str = "info") -> None:
    """Serve the OpenAI- and Anthropic-compatible HTTP API."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import serve as run_server

    cfg = EngineConfig(dtype=dtype, max_num_seqs=max_num_seqs,
                       served_model_name=served_model_name,
                       trace_path=str(trace) if trace else None)
    if replicas > 0:
        # NOTE: Ray is imported only here (issue 12: nothing of Ray without --replicas)
        from coda.scaleout.deploy import start_replicas, stop_replicas

        engine: Any = start_replicas(replicas, model, cfg, ray_address=ray_address,
                                     num_cpus=replica_cpus,
                                     torch_threads=max(1, int(replica_cpus)))
    else:
        engine = AsyncEngine.from_model_dir(model, cfg)
    durable = None
    if redis_url:
        from coda.server.durable import ServerDurable

        durable = ServerDurable(redis_url, retention_s=log_retention_s, lease_ttl_s=lease_ttl_s)
    try:
        run_server(engine, host=host, port=port, api_key=api_key, log_level=log_level,
                   durable=durable)
    finally:
        if replicas > 0:
            stop_replicas()


@app.command()
def generate(prompt: str,
             model: ModelOpt = None,
             max_tokens: int = 128,
             temperature: float = 0.8,
             top_p: float = 0.95,
             seed: Annotated[Optional[int], typer.Option()] = None,  # noqa: UP045
             stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,  # noqa: UP045
             chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
             deadline: Annotated[Optional[float], typer.Option(help="seconds")] = None,  # noqa: UP045
             dtype: str = "float32") -> None:
    """Stream one completion to the terminal, then its finish reason, usage and timings."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig, GenerationRequest
    from coda.sampling import SamplingParams

    engine = AsyncEngine.from_model_dir(model, EngineConfig(dtype=dtype, max_num_seqs=4))
    text = prompt
    if chat:
        from coda.server.chat import render_chat

        text = render_chat(engine, [{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    req = GenerationRequest(tuple(ids), SamplingParams(temperature=temperature, top_p=top_p,
                                                       seed=seed),
                            max_tokens=max_tokens, stop=tuple(stop or ()), deadline_s=deadline)

    async def run() -> int:
        handle = engine.submit(req)
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
                return 0 if t.state.value == "FINISHED" else 1
        return 1

    with engine:
        code = asyncio.run(run())
    raise typer.Exit(code)


@app.command()
def bench(model: ModelOpt = None,
          num_requests: Annotated[int, typer.Option("--num-requests", "-n")] = 64,
          concurrency: int = 32,
          max_tokens: int = 64,
          dtype: str = "float32",
          compare_hf: Annotated[bool, typer.Option("--compare-hf", help="also run transformers.generate")] = False,
          early_stop: Annotated[bool, typer.Option("--early-stop", help="compare with/without an early-stop policy")] = False,
          plot: Annotated[Optional[Path], typer.Option(help="write a PNG of the latency distributions")] = None,  # noqa: UP045
          seed: int = 0) -> None:
    """Run a workload; print throughput, TTFT and inter-token latency percentiles."""
    from coda.bench import BenchOptions, run_bench

    run_bench(BenchOptions(model_dir=model, num_requests=num_requests, concurrency=concurrency,
                           max_tokens=max_tokens, dtype=dtype, compare_hf=compare_hf,
                           early_stop=early_stop, plot=plot, seed=seed))


@trace_app.command("check")
def trace_check(path: Path) -> None:
    """Verify a JSONL trace against the invariants (one terminal, ordering, T1, L7)."""
    from coda.trace import check_trace, read_jsonl

    events = read_jsonl(path)
    problems = check_trace(events)
    n = len({e.request_id for e in events})
    if problems:
        for p in problems:
            typer.secho(p, fg="red")
        typer.echo(f"{len(problems)} problem(s) in {n} request(s), {len(events)} events")
        raise typer.Exit(1)
    typer.echo(f"ok: {n} request(s), {len(events)} events, every invariant holds")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
