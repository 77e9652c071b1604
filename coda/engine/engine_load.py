"""Loading a model into an engine's parts, and saying what was loaded (issue 9 items 1 and 4,
O1): :meth:`AsyncEngine.from_model_dir <coda.engine.async_engine.AsyncEngine.from_model_dir>`
builds its engine from :func:`load_parts`; ``describe`` and ``load_summary`` are
:func:`describe` and :func:`summary`. Nothing here runs for a request."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from coda.engine.draft import Drafter
from coda.engine.draft_load import describe as describe_draft
from coda.engine.draft_load import load_drafter, speculative_mode
from coda.engine.kv_budget import MemoryBudget, kv_cache_budget, kv_capacity, rss_bytes
from coda.engine.runner import ModelRunner
from coda.engine.speculative import refusal
from coda.engine.types import EngineConfig, EngineConfigError
from coda.models.kernels import check_isa
from coda.models.source import LoadedModel, open_model, resolve_model

if TYPE_CHECKING:
    from coda.engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class LoadParts:
    """What an engine is built from: the model, its runner (with the KV cache), the config
    as run (its speculative mode resolved), why the cache has its size, what the load took,
    and the draft model, if any."""

    loaded: LoadedModel
    runner: ModelRunner
    config: EngineConfig
    kv_reason: str
    load_s: float
    rss_at_load: int
    drafter: Drafter | None


def load_parts(model: str | Path | None, config: EngineConfig) -> LoadParts:
    """Load ``model`` (see :func:`coda.models.source.resolve_model`; None = the embedded
    model) under ``config``. Raises :class:`~coda.models.config.ModelLoadError` naming what is
    missing, :class:`~coda.models.kernels.KernelIsaError` for a refused ``CODA_KERNEL_ISA``,
    and EngineConfigError for a speculative mode the load cannot run exactly."""
    # NOTE: the config's own checks (EngineConfigError) ran when it was built; the pair
    # --speculative / --draft-model is checked here, before the load
    config = replace(config, speculative=speculative_mode(config.speculative,
                                                          config.draft_model))
    check_isa()  # NOTE: a refused CODA_KERNEL_ISA (KernelIsaError) too: never a fallback
    started = time.perf_counter()
    # NOTE: parsed (a typo fails at once) and measured before the weights take memory
    memory = (MemoryBudget.parse(config.memory_budget) if config.memory_budget is not None
              else MemoryBudget.default())
    loaded = open_model(resolve_model(model), quant=config.quant, dtype=config.dtype,
                        device=config.device, max_model_len=config.max_model_len)
    mc = loaded.config
    context = config.served_context(mc.max_context)
    budget = None
    if config.num_blocks is None:
        # NOTE: a --kv-cache-fraction is of the memory left after the weights
        budget = kv_cache_budget(
            bytes_per_token=mc.kv_bytes_per_token(loaded.dtype), block_size=config.block_size,
            context=context, max_num_seqs=config.max_num_seqs,
            kv_cache_bytes=config.kv_cache_bytes,
            memory_fraction=config.kv_cache_memory_fraction, memory_budget=memory,
            weights_bytes=loaded.weights_bytes)
    runner = ModelRunner(loaded.model, dtype=loaded.dtype,
                         device=config.device, block_size=config.block_size,
                         num_blocks=config.num_blocks,
                         kv_cache_bytes=budget.num_bytes if budget else None,
                         num_threads=config.num_threads)
    drafter = None
    if config.draft_model is not None:
        why = refusal(config.speculative, loaded.mode.batch_invariant
                      and runner.invariant_attention, loaded.mode.name)
        if why is not None:  # NOTE: said before the draft's weights are read
            raise EngineConfigError(why, field="speculative")
        drafter = load_drafter(config.draft_model, loaded, runner, quant=config.quant,
                               device=config.device, num_threads=config.num_threads)
    return LoadParts(loaded, runner, config,
                     kv_reason=budget.reason if budget else "num_blocks",
                     load_s=time.perf_counter() - started, rss_at_load=rss_bytes(),
                     drafter=drafter)


def describe(engine: AsyncEngine) -> list[str]:
    """What was loaded, for the CLI to print at start (issue 9 items 1 and 4)."""
    src, mc, b, mode = engine.source, engine.runner.config, engine.chat, engine.loaded.mode
    origin = f" (package {src.package})" if src.package else ""
    mib = engine.runner.kv.nbytes / 2**20
    took = ([f"loaded in {engine.load_s:.1f} s, RSS {engine.rss_at_load / 2**20:.0f} MiB at load"]
            if engine.load_s is not None and engine.rss_at_load is not None else [])
    return [f"model: {src.path}{origin} [{src.kind}]", *took] + [
        f"architecture {mc.arch}, {mc.num_parameters / 1e6:.1f}M parameters, "
        f"stored {engine.loaded.quantization}, context {engine.context_length}"
        + (f" (--max-model-len {engine.context_capped_from} capped to the model's "
           f"{mc.max_context})" if engine.context_capped_from else ""),
        f"serving mode (--quant): {mode.name}, "
        f"{'batch-invariant' if mode.batch_invariant else 'NOT batch-invariant (T4)'}; "
        f"{mode.numerics}",
        f"attention: {engine.runner.attention_note}",
        *engine.loaded.backend.describe(engine.loaded.model.kernels),
        f"speculative decoding: {engine.config.speculative}"
        + "".join(f", {v}" for v in describe_draft(engine.drafter).values()),
        f"chat template: {b.chat_template_origin}",
        f"end of generation: {b.describe_eos()}",
        f"KV cache: {mib:.0f} MiB reserved ({engine.kv_reason}), committed as written = "
        f"{kv_capacity(engine.runner.num_blocks, engine.runner.block_size, engine.context_length)}"
        f"; max_num_seqs {engine.config.max_num_seqs}",
    ] + ([f"context lowered from {engine.context_lowered_from} to {engine.context_length} "
          f"tokens: the KV cache holds no more (raise --memory-budget or "
          f"--kv-cache-bytes for more)"] if engine.context_lowered_from else [])


def summary(engine: AsyncEngine) -> dict[str, str | int | float | bool]:
    """What was loaded as one flat record (``coda serve`` logs it as one JSON line, O1)."""
    return {"model": str(engine.source.path), "source_kind": engine.source.kind,
            "model_snapshot": engine.model_snapshot, "stored": engine.loaded.quantization,
            **engine.loaded.backend.summary(engine.loaded.model.kernels),
            "context": engine.context_length,
            **({"context_capped_from": engine.context_capped_from}
               if engine.context_capped_from else {}),
            "kv_cache_bytes": int(engine.runner.kv.nbytes),  # NOTE: reserved (as before)
            "kv_cache_reserved_bytes": int(engine.runner.kv.nbytes),
            "kv_cache_committed_bytes": engine._kv_committed(), "kv_cache_reason": engine.kv_reason,
            **({"load_s": round(engine.load_s, 3)} if engine.load_s is not None else {}),
            **({"rss_bytes_at_load": engine.rss_at_load} if engine.rss_at_load is not None
               else {}),
            # NOTE: the native row kernel, or torch with the reason it was refused
            "attention": engine.runner.attention_note,
            "speculative": engine.config.speculative,  # issue 21 (coda.engine.speculative)
            **describe_draft(engine.drafter),
            **({"context_lowered_from": engine.context_lowered_from}
               if engine.context_lowered_from else {})}
