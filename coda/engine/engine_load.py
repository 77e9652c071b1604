"""Loading a model into an engine's parts, and deriving what the engine runs with from them
(issue 9 item 1, issue 19 item 3, issue 21; SPEC O1, T4):
:meth:`AsyncEngine.from_model_dir <coda.engine.async_engine.AsyncEngine.from_model_dir>`
builds its engine from :func:`load_parts`; its constructor takes the served context
(:func:`served_context`), the speculative configurations (:func:`speculative_configs`), the
trace sink (:func:`trace_sink`) and the scheduler (:func:`build_scheduler`) from here. What
the engine says about what was loaded is :mod:`coda.engine.engine_report`. Nothing here runs
for a request."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from coda.engine.draft import DRAFT_CONFIG, Drafter
from coda.engine.draft_load import build_drafter, draft_share, open_draft, speculative_mode
from coda.engine.kv_budget import KVBudget, MemoryBudget, kv_cache_budget, rss_bytes
from coda.engine.kv_cache import BlockManager
from coda.engine.runner import ModelRunner
from coda.engine.scheduler import Scheduler, SchedulerConfig
from coda.engine.speculative import PREDICTION_PRIOR, SpeculativeConfig, refusal
from coda.engine.types import EngineConfig, EngineConfigError
from coda.engine.verify_costs import VerifyCosts
from coda.models.kernels import check_isa
from coda.models.source import LoadedModel, open_model, resolve_model
from coda.trace import JsonlTraceSink, NullTraceSink, RecentTraceSink, TraceSink

log = logging.getLogger("coda.engine")

# NOTE: the logits of one step's prompt-scoring rows (echo, prompt logprobs), at most
SCORING_LOGITS_BYTES = 64 << 20


@dataclass(frozen=True)
class LoadParts:
    """What an engine is built from: the model, its runner (with the KV cache), the config
    as run (its speculative mode resolved), why the cache has its size, what the load took,
    and the draft model, if any."""

    loaded: LoadedModel
    runner: ModelRunner
    config: EngineConfig
    kv_reason: str
    kv_budget: KVBudget | None  # NOTE: None: sized by num_blocks
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
    draft = None
    if config.draft_model is not None:
        # NOTE: the runner's attention is invariant (its default) where the mode is
        why = refusal(config.speculative, loaded.mode.batch_invariant, loaded.mode.name)
        if why is not None:  # NOTE: said before the draft's weights are read
            raise EngineConfigError(why, field="speculative")
        # NOTE: before the target's cache is sized: the draft's weights and cache are in the
        # same budget (issue 21; kv_cache_budget's one split)
        draft = open_draft(config.draft_model, loaded, quant=config.quant, device=config.device)
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
            weights_bytes=loaded.weights_bytes,
            draft=draft_share(draft) if draft is not None else None)
    runner = ModelRunner(loaded.model, dtype=loaded.dtype,
                         device=config.device, block_size=config.block_size,
                         num_blocks=config.num_blocks,
                         kv_cache_bytes=budget.num_bytes if budget else None,
                         num_threads=config.num_threads)
    drafter = (build_drafter(draft, loaded, runner, device=config.device,
                             num_threads=config.num_threads) if draft is not None else None)
    return LoadParts(loaded, runner, config,
                     kv_reason=budget.reason if budget else "num_blocks", kv_budget=budget,
                     load_s=time.perf_counter() - started, rss_at_load=rss_bytes(),
                     drafter=drafter)


def served_context(loaded: LoadedModel, runner: ModelRunner, config: EngineConfig
                   ) -> tuple[int, int | None, int | None]:
    """The context an engine serves, the ``--max-model-len`` capped to the model's own context
    (or None) and the context lowered to the cache (or None)."""
    context = config.served_context(runner.config.max_context)
    # NOTE: past the model's own context --max-model-len is capped, not refused (one flag
    # serves every model of a several-model server), and said: a warning and the summary
    asked = config.max_model_len
    capped_from = asked if asked and asked > context else None
    if capped_from is not None:
        log.warning(f"--max-model-len {asked} is more than the model's context of "
                    f"{context} tokens: serving {context} ({loaded.source.name})")
    capacity = runner.num_blocks * runner.block_size
    # NOTE: a cache smaller than one full context lowers the served context (said at load),
    # so every request the server accepts fits the cache alone and none waits forever
    lowered_from = context if capacity < context else None
    return min(context, capacity), capped_from, lowered_from


def speculative_configs(loaded: LoadedModel, runner: ModelRunner, config: EngineConfig,
                        drafter: Drafter | None
                        ) -> tuple[SpeculativeConfig | None, SpeculativeConfig | None]:
    """The engine's speculative configuration (None: ``--speculative off``) and a chat
    prediction's (None where the mode does not verify exactly). Raises EngineConfigError for
    a mode the load cannot run exactly, or a draft model without ``--speculative draft``."""
    invariant = loaded.mode.batch_invariant and runner.invariant_attention
    why = refusal(config.speculative, invariant, loaded.mode.name)
    if why is not None:  # NOTE: issue 21: said at start, nothing served inexactly
        raise EngineConfigError(why, field="speculative")
    if (config.speculative == "draft") != (drafter is not None):
        raise EngineConfigError("--speculative draft runs with a loaded --draft-model, and "
                                "only then", field="draft_model")
    # NOTE: prompt lookup prices k by this engine's measured batch-1 verifications, on the
    # engine thread's CPU time on the CPU (coda.engine.verify_costs)
    costs = VerifyCosts(SpeculativeConfig.k_max, SpeculativeConfig.step_rows,
                        clock=time.thread_time if runner.device.type == "cpu"
                        else time.monotonic)
    speculative = (None if config.speculative == "off" else
                   DRAFT_CONFIG if drafter is not None else SpeculativeConfig(costs=costs))
    # NOTE: a chat prediction drafts wherever the mode verifies exactly, the flag or not
    # (its own tokens too under prompt lookup); elsewhere it is only counted. Its k is
    # priced by the measured forwards where the engine times them (the flag on), else by
    # the row rule: a plain request never enters the timing (issue 22)
    lookup = config.speculative == "prompt-lookup"
    predicted = (SpeculativeConfig(costs=costs if lookup else None,
                                   prior_accept=PREDICTION_PRIOR, lookup=lookup)
                 if invariant else None)
    return speculative, predicted


def trace_sink(config: EngineConfig) -> TraceSink:
    """The sink ``config`` asks for: a JSONL file (``trace_path``), the recent requests kept
    in memory (``recent_traces``) in front of it, or both, or nothing."""
    trace: TraceSink = (JsonlTraceSink(config.trace_path) if config.trace_path
                        else NullTraceSink())
    if config.recent_traces > 0:
        trace = RecentTraceSink(config.recent_traces, inner=None if isinstance(
            trace, NullTraceSink) else trace)
    return trace


def build_scheduler(runner: ModelRunner, config: EngineConfig) -> Scheduler:
    """The scheduler over a block manager of ``runner``'s KV cache."""
    blocks = BlockManager(runner.num_blocks, runner.block_size,
                          enable_prefix_caching=config.enable_prefix_caching)
    # NOTE: a step's prompt-scoring rows each hold a float32 vocabulary of logits: at most
    # SCORING_LOGITS_BYTES of them (512 rows of a 262k vocabulary were 0.5 GB)
    rows = max(16, SCORING_LOGITS_BYTES // (4 * runner.config.vocab_size))
    return Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                     config.long_prefill_chunk, config.enable_prefix_caching,
                                     scoring_rows=min(rows, config.long_prefill_chunk)),
                     blocks)
