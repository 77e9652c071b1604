"""The llguidance tokenizer: built once per tokenizer, off the request path (SPEC G1, S1).

:func:`compile_grammar` (:mod:`coda.engine.grammar`) needs llguidance's view of the model's
tokenizer. Building it is cached per tokenizer object, and is prepared once the model is loaded
(:func:`warm_ll_tokenizer`, from the engine's start, on a thread of its own): it costs seconds
on a 262k vocabulary (Gemma 3), which the first grammar request would otherwise pay inside its
submit. llguidance holds the GIL while it builds (no call of its Python API releases it), so
the build *waits* first: until released (a server defers it and releases it once it has
answered and no request came for a moment, so ``/health`` and whatever comes first never queue
behind it), until a grammar request asks for the tokenizer (it is then built on that thread,
never the request's, and the request waits for it), or, not deferred, until
:data:`WARMUP_HOLD_S` passed. It is built in two halves (the tokenizer, then its mask slices)
with a pause between them, so the longest hold of the GIL is about half of it. The build's time
is logged (``grammar tokenizer built``, on the ``coda.engine.grammar`` logger).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:  # NOTE: imported by the first grammar, not by the server's start (issue 19)
    import llguidance as llg

__all__ = ["GrammarWarmup", "ll_tokenizer", "warm_ll_tokenizer"]

# NOTE: the grammar module's logger: the build's lines are the grammar's, as they were
log = logging.getLogger("coda.engine.grammar")

_cache_lock = threading.Lock()
_tokenizer_cache: weakref.WeakKeyDictionary[tokenizers.Tokenizer,
                                            dict[tuple[int, ...], llg.LLTokenizer]] = (
    weakref.WeakKeyDictionary())


# NOTE: how long a prepared build waits for its release before it starts anyway (no server,
# or none that answered): a library's first grammar request asks for it sooner
WARMUP_HOLD_S = 2.0
# NOTE: the pause between the build's two halves: the event loop's turn at the GIL
_HALVES_PAUSE_S = 0.02
_pending: weakref.WeakKeyDictionary[tokenizers.Tokenizer, GrammarWarmup] = (
    weakref.WeakKeyDictionary())


def ll_tokenizer(tokenizer: tokenizers.Tokenizer,
                 eos_token_ids: frozenset[int]) -> llg.LLTokenizer:
    """The llguidance tokenizer for ``tokenizer`` with these EOS ids, built once and cached
    (keyed weakly by the tokenizer object, so a dropped engine frees it). A prepared warm-up
    for it (:func:`warm_ll_tokenizer`) is released and waited for instead of building here."""

    eos = tuple(sorted(eos_token_ids))
    warm = _pending.get(tokenizer)
    # NOTE: ``ident`` is None for the instant between the registration and the thread's start
    if (warm is not None and warm.eos == eos and warm.thread.ident is not None
            and threading.current_thread() is not warm.thread):
        warm.release()  # NOTE: built on the warm-up's thread; a failure builds again below
        warm.join()
    with _cache_lock:
        per_tok = _tokenizer_cache.setdefault(tokenizer, {})
        cached = per_tok.get(eos)
        if cached is None:
            cached = _build_ll_tokenizer(tokenizer, list(eos) or None)
            per_tok[eos] = cached
        return cached


class GrammarWarmup:
    """:func:`ll_tokenizer`'s entry for one tokenizer, built on a daemon thread
    (``coda-grammar-tokenizer``) once released or after ``hold_s`` (see the module contract)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: frozenset[int],
                 model: str, hold_s: float) -> None:
        self.eos = tuple(sorted(eos_token_ids))
        self.model = model
        self.hold_s = hold_s
        self.deferred = False
        self._go = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(tokenizer, eos_token_ids),
                                       name="coda-grammar-tokenizer", daemon=True)

    def release(self) -> None:
        """Start the build now (if it has not started yet)."""
        self._go.set()

    def defer(self) -> None:
        """Wait for :meth:`release` (or a grammar request) only, not for the hold's end: a
        server releases it once it has answered and gone idle."""
        self.deferred = True

    @property
    def released(self) -> bool:
        return self._go.is_set()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: frozenset[int]) -> None:
        try:
            end = time.monotonic() + self.hold_s
            while not self._go.is_set() and (self.deferred or time.monotonic() < end):
                # NOTE: short waits: a defer() during the hold is seen within 0.1 s
                self._go.wait(0.1 if self.deferred else min(0.1, end - time.monotonic()))
            self._go.set()  # NOTE: released by the hold's end: ``released`` says it started
            self._build(tokenizer, eos_token_ids)
        finally:
            if _pending.get(tokenizer) is self:
                del _pending[tokenizer]

    def _build(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: frozenset[int]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            tok = ll_tokenizer(tokenizer, eos_token_ids)
        except Exception as exc:  # NOTE: said to the grammar request (a 400), not here
            log.info("grammar tokenizer not built", extra={"model": self.model,
                                                            "error": str(exc)})
            return
        log.info("grammar tokenizer built", extra={
            "model": self.model, "vocab_size": tok.vocab_size,
            "grammar_tokenizer_s": round(time.perf_counter() - wall, 3),
            "grammar_tokenizer_cpu_s": round(time.thread_time() - cpu, 3)})


def warm_ll_tokenizer(tokenizer: tokenizers.Tokenizer, eos_token_ids: frozenset[int],
                      model: str = "", hold_s: float | None = None) -> GrammarWarmup:
    """Prepare :func:`ll_tokenizer`'s entry for ``tokenizer``: a daemon thread builds it once
    released (:meth:`GrammarWarmup.release`), asked for by a grammar request, or after
    ``hold_s`` seconds (:data:`WARMUP_HOLD_S` by default); logs ``grammar tokenizer built`` with the seconds it took (wall and
    this thread's CPU). A tokenizer llguidance cannot take is left unbuilt (logged): the first
    grammar request then says why, as it did before."""
    warm = GrammarWarmup(tokenizer, eos_token_ids, model,
                         WARMUP_HOLD_S if hold_s is None else hold_s)
    _pending[tokenizer] = warm
    warm.thread.start()
    return warm


def _build_ll_tokenizer(tokenizer: tokenizers.Tokenizer,
                        eos: list[int] | None) -> llg.LLTokenizer:
    import llguidance as llg

    from coda.models.gguf_spm import spm_token_bytes

    spm = spm_token_bytes(tokenizer)
    if spm is None:
        # NOTE: the HF tokenizer JSON carries the vocabulary, added tokens and pre-tokenizer
        return _with_slices(llg.LLTokenizer(tokenizer.to_str(), eos_token=eos, slices=[]))
    # NOTE: a GGUF SentencePiece tokenizer's JSON is only its lookup table (llama.cpp's
    # merging is no BPE): llguidance tokenizes through its exact encode instead, so the
    # budget closer's canonical completions count the tokens the model really spells
    tokens, special = spm

    class _Exact:
        eos_token_id = (eos or [0])[0]
        bos_token_id = None
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            return list(tokenizer.encode(text.decode("utf-8", "replace"),
                                         add_special_tokens=False).ids)

    return _with_slices(llg.LLTokenizer(llg.TokenizerWrapper(_Exact()), eos_token=eos, slices=[]))


def _with_slices(base: llg.LLTokenizer) -> llg.LLTokenizer:
    """``base`` (built without slices) with llguidance's default mask slices: the second half
    of the build, after a pause in which other threads (the event loop) hold the GIL."""
    import llguidance as llg

    time.sleep(_HALVES_PAUSE_S)
    return base.with_slices(llg.LLTokenizer.general_slices())
