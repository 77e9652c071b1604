"""What an engine says about itself (issue 9 items 1 and 4, issue 19 item 3; SPEC O1): what
was loaded, printed by the CLI at start (:func:`describe`) and logged by ``coda serve`` as one
JSON line (:func:`summary`), the model's card (:func:`model_info`) and the gauges ``/metrics``
reads (:func:`stats`), each the :class:`~coda.engine.async_engine.AsyncEngine` method of that
name. Nothing here runs for a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coda.engine.draft_load import describe as describe_draft
from coda.engine.kv_budget import kv_capacity
from coda.engine.protocol import ModelInfo
from coda.engine.types import EngineStats

if TYPE_CHECKING:
    from coda.engine.async_engine import AsyncEngine


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
        *memory_line(engine),
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
            "kv_cache_committed_bytes": kv_committed(engine), "kv_cache_reason": engine.kv_reason,
            **({"load_s": round(engine.load_s, 3)} if engine.load_s is not None else {}),
            **({"rss_bytes_at_load": engine.rss_at_load} if engine.rss_at_load is not None
               else {}),
            # NOTE: the native row kernel, or torch with the reason it was refused
            "attention": engine.runner.attention_note,
            "speculative": engine.config.speculative,  # issue 21 (coda.engine.speculative)
            **describe_draft(engine.drafter), **memory_split(engine),
            **({"context_lowered_from": engine.context_lowered_from}
               if engine.context_lowered_from else {})}


def memory_split(engine: AsyncEngine) -> dict[str, int]:
    """What the memory budget holds (issue 19 item 3, issue 21): the budget when one sized the
    caches, the weights, and a draft model's weights and reserved KV cache (the target's cache
    is ``kv_cache_reserved_bytes``); with a budget they sum within it."""
    split = {"weights_bytes": engine.loaded.weights_bytes}
    if engine.memory_budget is not None:
        split["memory_budget_bytes"] = engine.memory_budget
    if engine.drafter is not None:
        split["draft_weights_bytes"] = engine.drafter.weights_bytes
        split["draft_kv_cache_bytes"] = int(engine.drafter.runner.kv.nbytes)
    return split


def memory_line(engine: AsyncEngine) -> list[str]:
    """The start line saying how the budget is split (none without a budget or a draft)."""
    s = memory_split(engine)
    if "memory_budget_bytes" not in s and engine.drafter is None:
        return []
    parts = [f"weights {s['weights_bytes'] / 2**20:.1f} MiB",
             f"KV cache {engine.runner.kv.nbytes / 2**20:.1f} MiB"]
    if engine.drafter is not None:
        parts += [f"draft weights {s['draft_weights_bytes'] / 2**20:.1f} MiB",
                  f"draft KV cache {s['draft_kv_cache_bytes'] / 2**20:.1f} MiB"]
    head = (f"memory budget {s['memory_budget_bytes'] / 2**20:.1f} MiB: "
            if "memory_budget_bytes" in s else "memory (no budget): ")
    return [head + " + ".join(parts)]


def model_info(engine: AsyncEngine) -> ModelInfo:
    """:meth:`AsyncEngine.model_info <coda.engine.async_engine.AsyncEngine.model_info>`."""
    mc = engine.runner.config
    return ModelInfo(engine.model_name, engine.context_length, engine.eos_token_ids,
                     architecture=mc.arch, parameters=mc.num_parameters,
                     quantization=engine.loaded.quantization,
                     modified=engine.loaded.source.modified)


def stats(engine: AsyncEngine) -> EngineStats:
    """:meth:`AsyncEngine.stats <coda.engine.async_engine.AsyncEngine.stats>`."""
    bm = engine.core.scheduler.block_manager
    return EngineStats(
        num_running=engine.core.scheduler.num_running,
        num_waiting=engine.num_waiting(),
        kv_cache_usage=bm.usage, num_blocks=bm.num_blocks,
        num_free_blocks=bm.num_free_blocks, num_requests_total=engine.num_requests_total,
        num_preemptions_total=engine.core.num_preemptions_total,
        kv_cache_reserved_bytes=int(engine.runner.kv.nbytes),
        kv_cache_committed_bytes=kv_committed(engine),
        embed_chunks_total=engine.embed_chunks, embeds_cancelled_total=engine.embeds_cancelled)


def kv_committed(engine: AsyncEngine) -> int:
    """KV bytes ever written: the touched blocks' share of the reservation (the blocks
    are taken lowest id first, so they are a prefix of every K/V plane)."""
    bm = engine.core.scheduler.block_manager
    return int(engine.runner.kv.nbytes) * bm.num_touched_blocks // bm.num_blocks
