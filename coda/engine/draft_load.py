"""Loading the draft model (issue 21 item 2; SPEC T4, E1): the server's speculative mode from
``--speculative`` and ``--draft-model``, the draft refused where it cannot propose the target's
tokens, and the :class:`~coda.engine.draft.Drafter` over its own runner and KV cache.
What the drafter does each step: :mod:`coda.engine.draft`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import tokenizers

from coda.engine.draft import Drafter
from coda.engine.kv_budget import DRAFT_SPARE_BLOCKS, DraftShare
from coda.engine.runner import ModelRunner
from coda.engine.speculative import SpeculativeConfig
from coda.engine.speculative_costs import DraftCosts
from coda.engine.types import EngineConfigError
from coda.models.load_errors import DraftModelLoadError
from coda.models.source import LoadedModel, open_model, resolve_model

MODE = "draft"


def speculative_mode(speculative: str, draft_model: str | None) -> str:
    """The speculative mode a server runs, given ``--speculative`` and ``--draft-model``:
    ``--draft-model`` implies ``draft``; raises :class:`EngineConfigError` (a ValueError)
    naming ``draft_model`` or ``speculative`` on a contradiction."""
    if draft_model is None:
        if speculative == MODE:
            raise EngineConfigError("--speculative draft needs --draft-model MODEL (a model "
                                    "that shares the target's tokenizer)", field="draft_model")
        return speculative
    if speculative not in ("off", MODE):
        raise EngineConfigError(f"--draft-model drafts with a model; --speculative "
                                f"{speculative} drafts another way: give one of them",
                                field="speculative")
    return MODE


def vocabulary_mismatch(target: tokenizers.Tokenizer, draft: tokenizers.Tokenizer,
                        target_logits: int, draft_logits: int) -> str | None:
    """Why a draft cannot propose tokens for the target (None: same vocabulary): its token
    ids must mean the same strings, and its logits must be as wide (the same draw picks the
    same id)."""
    if target_logits != draft_logits:
        return (f"its logits cover {draft_logits} token ids, the target's {target_logits}")
    tv, dv = target.get_vocab(with_added_tokens=True), draft.get_vocab(with_added_tokens=True)
    if tv != dv:
        differ = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])
        token, tid = differ[0]
        return (f"its vocabulary differs from the target's ({len(tv)} vs {len(dv)} tokens; "
                f"{len(differ)} (token, id) pairs differ, e.g. {token!r} = {tid})")
    return None


def open_draft(spec: str, target: LoadedModel, *, quant: str = "auto",
               device: str = "cpu") -> LoadedModel:
    """Load ``spec`` (anything ``--model`` takes) as the draft of ``target``, weights only:
    through the target's loader, refused (DraftModelLoadError, naming the draft and the flag,
    before anything is served) where it cannot be loaded or does not share the target's
    vocabulary. Its weights and bytes per token go into the memory budget before the target's
    cache is sized (:class:`~coda.engine.kv_budget.DraftShare`); then :func:`build_drafter`."""
    try:
        draft = open_model(resolve_model(spec), quant=quant, device=device)
    except ValueError as exc:  # NOTE: ModelLoadError, a --quant the draft refuses: the draft's
        raise DraftModelLoadError(f"cannot load the draft model {spec} (--draft-model): "
                                  f"{exc}") from exc
    why = vocabulary_mismatch(target.bundle.tokenizer, draft.bundle.tokenizer,
                              target.config.vocab_size, draft.config.vocab_size)
    if why is not None:
        raise DraftModelLoadError(f"the draft model {spec} (--draft-model) does not fit: {why}; "
                                  "a draft model must share the target's tokenizer")
    return draft


def draft_share(draft: LoadedModel) -> DraftShare:
    """What ``draft`` takes of the memory budget (its weights, its cache's bytes per token)."""
    return DraftShare(draft.weights_bytes, draft.config.kv_bytes_per_token(draft.dtype))


def build_drafter(draft: LoadedModel, target: LoadedModel, target_runner: ModelRunner, *,
                  device: str = "cpu", num_threads: int | None = None) -> Drafter:
    """The :class:`Drafter` over ``draft`` (from :func:`open_draft`): its KV cache holds as
    many tokens as the target's, plus :data:`~coda.engine.kv_budget.DRAFT_SPARE_BLOCKS` blocks
    for the drafts of a full batch (what the budget counted for it)."""
    bs = target_runner.block_size
    runner = ModelRunner(draft.model, dtype=draft.dtype, device=device, block_size=bs,
                         num_blocks=target_runner.num_blocks + DRAFT_SPARE_BLOCKS,
                         num_threads=num_threads)
    # NOTE: on the CPU the engine thread's own CPU time: a shared machine's waits for a core
    # would price a forward by the load, not by its rows (the thread pool's other threads
    # share each forward alike, so the ratios hold)
    clock = time.thread_time if device == "cpu" else time.monotonic
    return Drafter(runner, str(draft.source.path), target.bundle.eos_token_ids,
                   costs=DraftCosts(SpeculativeConfig().step_rows), clock=clock,
                   weights_bytes=draft.weights_bytes)


def describe(drafter: Drafter | None) -> Mapping[str, str]:
    """The load summary's draft fields (none without a draft)."""
    if drafter is None:
        return {}
    mc = drafter.runner.config
    return {"draft_model": drafter.name,
            "draft_architecture": f"{mc.arch}, {mc.num_parameters / 1e6:.1f}M parameters, "
                                  f"{mc.num_layers} layers"}
