"""``coda serve``'s checks of its options, each before any work (a bad value is one line and
exit 2, not a traceback once the model has loaded), and the several-models router's load."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda.commands.loading import fail, refuse_exact_and_fraction, refuse_two_kv_sizes

if TYPE_CHECKING:
    from coda.commands.serve import ServeArgs
    from coda.engine.types import EngineConfig
    from coda.server.model_specs import ModelSpec

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def check_flags(args: ServeArgs) -> None:
    """The flags a typer bound cannot check: the log level, ``--max-waiting 0``, an empty
    ``--api-key`` or ``--served-model-name``, and the durations and CPU share that must be
    above 0 (a typer ``min`` allows 0 itself)."""
    if args.log_level.lower() not in LOG_LEVELS:  # NOTE: uvicorn's levels; others were a traceback
        fail(f"--log-level {args.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    if args.api_key is not None and not args.api_key.strip():
        # NOTE: an empty key (``--api-key "$KEY"`` with KEY unset) served with no auth at all
        fail("--api-key is empty: the server would require no key; give a key, or omit it")
    if args.served_model_name is not None and not args.served_model_name.strip():
        # NOTE: an empty name was ignored: the model was served under its own name
        fail("--served-model-name is empty; give a name, or omit it")
    for flag, value in (("--log-retention-s", args.log_retention_s),
                        ("--lease-ttl-s", args.lease_ttl_s), ("--replica-cpus", args.replica_cpus)):
        # NOTE: NaN fails the comparison; they were accepted and went unchecked, or (with
        # --redis-url) a ValueError after the port and before the model
        if not 0 < value < float("inf"):
            fail(f"{flag} must be a number > 0, got {value}")
    refuse_exact_and_fraction(args.kv_cache_bytes, args.kv_cache_fraction)
    if args.max_waiting == 0:  # NOTE: nothing may wait: a busy server refuses every request
        fail("--max-waiting 0 would let no request wait for a batch slot (each one past the "
             "free slots refused); use 1 or more, or -1 for unbounded")


def check_redis(url: str) -> None:
    """``--redis-url``: a URL Redis cannot take (no ``redis://``, ``rediss://`` or ``unix://``)
    and a Redis that does not answer are one line and exit 2 before the model loads. They were
    a traceback (ValueError, exit 1) and, unreachable, the startup's traceback logged after the
    model had loaded (uvicorn's exit 3)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    except ValueError as exc:
        fail(f"--redis-url {url}: {exc}")
    try:
        client.ping()
    except redis.RedisError as exc:
        fail(f"--redis-url {url}: Redis does not answer: {exc}")
    finally:
        client.close()


def unwritable(path: Path) -> str | None:
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


def serves_several(args: ServeArgs) -> bool:
    """Several models (issue 23): ``--model`` repeated, a models file, a memory budget or a
    pin; the flags that serve one model only are refused with them."""
    models = len(args.model) > 1 or args.models_file is not None or bool(args.pin)
    # NOTE: with --draft-model and one model, --memory-budget is that engine's budget for
    # target + draft (issue 21; one_model_budget), not the router's
    several = models or (bool(args.memory_budget) and not args.draft_model)
    if (several or args.memory_budget) and (args.replicas > 0 or args.served_model_name
                                            or args.redis_url):
        # NOTE: a replica serves one model; names come from NAME=SPEC, not one flag; the
        # durable log's engine wrapper does not route by model (not built yet)
        fail("several models (--model repeated, --models-file, --memory-budget, --pin) are "
             "not supported with --replicas, --redis-url or --served-model-name (name each "
             "model as --model NAME=SPEC)")
    if several and args.draft_model:  # NOTE: a draft must share ONE target's tokenizer (issue 21)
        fail("--draft-model drafts for one model; it is not supported with several models")
    return several


def one_model(args: ServeArgs, cfg: EngineConfig) -> tuple[ModelSpec | None, EngineConfig]:
    """One ``--model`` is SPEC or NAME=SPEC as with several (NAME: the served name, which a
    different ``--served-model-name`` contradicts: exit 2)."""
    from coda.server.model_specs import parse_model_arg

    one = parse_model_arg(args.model[0]) if args.model else None
    if one is not None and one.name is not None:
        if args.served_model_name is not None and args.served_model_name != one.name:
            fail(f"--model {args.model[0]} names the model {one.name!r} and "
                 f"--served-model-name {args.served_model_name!r}: give one")
        cfg = replace(cfg, served_model_name=one.name)
    return one, cfg


def one_model_budget(args: ServeArgs, cfg: EngineConfig) -> EngineConfig:
    """One model with ``--draft-model``: ``--memory-budget`` bounds the engine's weights and
    caches, the draft's included (``EngineConfig.memory_budget``, issue 21); with
    ``--kv-cache-bytes`` or ``--kv-cache-fraction`` it is the usage error ``coda generate``
    gives (each sizes the cache; one would be ignored). Exit 2 before the load."""
    if args.memory_budget is None:
        return cfg
    refuse_two_kv_sizes(args.kv_cache_bytes, args.kv_cache_fraction, args.memory_budget)
    return replace(cfg, memory_budget=args.memory_budget)


def load_router(args: ServeArgs, cfg: EngineConfig) -> Any:
    """Several models (issue 23): each described now (names, tokenizer, context; no weights),
    loaded in its own worker process on first use. Bad specs exit 2 with the message.
    ``--memory-budget`` takes the forms the one-model budget takes (``MemoryBudget.parse``:
    8GiB, 8G, 512MiB, bytes, 40% of the memory available now); the option's own check
    (``coda/cli.py``) has refused any other value before any work."""
    from coda.engine.kv_budget import MemoryBudget
    from coda.models.config import ModelLoadError
    from coda.server.model_router import build_router
    from coda.server.model_specs import ModelSpecError, collect_specs

    try:
        specs = collect_specs(list(args.model), args.models_file, list(args.pin))
        budget = (MemoryBudget.parse(args.memory_budget).num_bytes
                  if args.memory_budget is not None else None)
        return build_router(specs, cfg, memory_budget=budget, log_level=args.log_level)
    except (ModelSpecError, ModelLoadError, ValueError) as exc:
        fail(str(exc))
