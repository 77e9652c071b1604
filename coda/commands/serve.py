"""``coda serve``: check the options, bind the port, load one model (or the several-models
router, or Ray replicas), then serve until SIGINT/SIGTERM (``coda.server.app.serve``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coda.commands.loading import (
    engine_config,
    fail,
    interrupt_exits,
    load_engine,
    refuse_bad_isa,
)
from coda.commands.serve_checks import (
    check_flags,
    check_redis,
    load_router,
    one_model,
    one_model_budget,
    serves_several,
    unwritable,
)
from coda.commands.startup import preload_torch_libraries, startup_gc


@dataclass(frozen=True)
class ServeArgs:
    """``coda serve``'s options as typed (their help: ``coda/cli.py``)."""

    model: tuple[str, ...]
    models_file: Path | None
    memory_budget: str | None
    pin: tuple[str, ...]
    host: str
    port: int
    api_key: str | None
    quant: str
    dtype: str | None
    max_num_seqs: int
    served_model_name: str | None
    trace: Path | None
    max_body_bytes: int
    max_waiting: int
    recent_traces: int
    redis_url: str | None
    log_retention_s: float
    lease_ttl_s: float
    replicas: int
    ray_address: str | None
    replica_cpus: float
    log_level: str
    max_model_len: int | None
    kv_cache_bytes: int | None
    kv_cache_fraction: float | None
    threads: int | None
    speculative: str
    draft_model: str | None


def run_serve(args: ServeArgs) -> None:
    """Serve the HTTP API until a signal ends it; every bad option exits 2 before the model
    loads (the port is bound first, so a busy one is said in a second)."""
    check_flags(args)
    refuse_bad_isa()
    with startup_gc():
        # NOTE: first: it runs beside the checks, the bind and the server's imports below
        if args.replicas == 0:
            preload_torch_libraries()
        from coda.optional import MissingDependency, require
        from coda.server.listen import ListenError, bind_listener

        # NOTE: the extras first (issue 24 item 5): one message naming them, before any work
        try:
            require(*(["replicas"] if args.replicas > 0 or args.ray_address else []),
                    *(["redis"] if args.redis_url else []))
        except MissingDependency as exc:
            fail(str(exc))
        if args.trace is not None and (why := unwritable(args.trace)) is not None:
            fail(f"--trace {args.trace}: {why}")
        # NOTE: the port first: a busy port is said in a second, not after the model loaded
        try:
            sock = bind_listener(args.host, args.port)
        except ListenError as exc:
            fail(str(exc))
        if args.redis_url:
            check_redis(args.redis_url)
        from coda.server.app import serve as run_server
        from coda.server.logs import configure_logging
        from coda.server.state import ServerSettings

        cfg = engine_config(quant=args.quant, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                           served_model_name=args.served_model_name,
                           trace_path=str(args.trace) if args.trace else None,
                           max_model_len=args.max_model_len,
                           kv_cache_bytes=args.kv_cache_bytes,
                           kv_cache_memory_fraction=args.kv_cache_fraction,
                           num_threads=args.threads, recent_traces=args.recent_traces,
                           speculative=args.speculative, draft_model=args.draft_model)
        # NOTE: serve's --memory-budget is the several-models router's (one model included): it
        # gives each model its share (weights + KV); without it one model takes the default budget;
        # with --draft-model (one model) it is that engine's, the draft's weights and KV inside
        # NOTE: the server's stderr is JSON lines only (O1): what was loaded is logged, not echoed
        configure_logging(args.log_level)
        several = serves_several(args)
        one = None
        if not several:
            one, cfg = one_model(args, cfg)
            cfg = one_model_budget(args, cfg)
        durable = None
        if args.redis_url:
            from coda.server.durable import ServerDurable

            durable = ServerDurable(args.redis_url, retention_s=args.log_retention_s,
                                    lease_ttl_s=args.lease_ttl_s)
        if several:
            engine: Any = load_router(args, cfg)
        elif args.replicas > 0:
            # NOTE: Ray is imported only here (issue 12: nothing of Ray without --replicas)
            from coda.scaleout.deploy import start_replicas, stop_replicas

            # NOTE: with a log the replicas write it themselves (chosen here, once)
            engine = start_replicas(args.replicas, one.model if one else None, cfg,
                                    ray_address=args.ray_address, num_cpus=args.replica_cpus,
                                    torch_threads=max(1, int(args.replica_cpus)),
                                    log=durable.log if durable is not None else None)
        else:
            logger = logging.getLogger("coda.server")
            # NOTE: a Ctrl-C while the model loads: one log line, exit 130 at once (no worker
            # process nor replica to stop yet; the bound socket closes with the process)
            with interrupt_exits("while loading the model", logger.warning):
                engine = load_engine(one.model if one else None, cfg, logger.info)
    settings = ServerSettings(max_body_bytes=args.max_body_bytes,
                              max_waiting=None if args.max_waiting < 0 else args.max_waiting)
    try:
        run_server(engine, host=args.host, port=args.port, api_key=args.api_key,
                   log_level=args.log_level, settings=settings, durable=durable, sock=sock)
    finally:
        if args.replicas > 0:
            stop_replicas(engine)
