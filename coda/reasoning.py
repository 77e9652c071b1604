"""Reasoning output: splitting ``<think>…</think>`` from the answer (issue 23 item 3; SPEC K2,
S1, S2, L6). Pure Python.

A reasoning model writes its reasoning between two markers its chat template names (Qwen3,
DeepSeek-R1: ``<think>`` and ``</think>``, tokens of the vocabulary). The template may open the
block in the generation prompt itself (DeepSeek-R1 puts ``<think>\\n`` there): the output then
starts *inside* the reasoning. Otherwise the output may start with the opening marker.

:class:`ReasoningSplitter` cuts the detokenized output bytes into three parts, in order::

    [opener] reasoning  closer  answer           (opener only when the prompt left it open)

The markers themselves are never sent: they are removed spans, recorded on the terminal
(:class:`ReasoningSplit`), so the K2 byte invariant holds over both parts together::

    full decode == opener + (reasoning deltas) + closer + (answer deltas)   [+ the usual K2
                                                                              removed spans]

Bytes that could still become the closer are held back from the reasoning (like a stop
string's prefix, S2) until ruled out or the output ends; text after the closer is the answer,
and only the answer meets stop strings, stop ids and their holdback (S1): nothing in the
reasoning is ever matched, cut or hidden by a stop. An output that never opens a reasoning
block (its first bytes rule out the opener) is all answer; one that never closes it is all
reasoning.

A request's :class:`ReasoningSpec` comes from the model's markers (:func:`reasoning_spec`): the
tokenizer's ``<think>`` / ``</think>`` tokens (Qwen3, DeepSeek-R1 distills declare both as added
tokens). Whether the output starts inside the reasoning is read from the prompt's token ids —
the rendered generation prompt ends inside a block when its last opener comes after its last
closer (DeepSeek-R1's template ends with ``<think>\\n``) — so every protocol decides it the same
way, from the ids it already has; renderers read the split from the stream
(``StreamEvent.reasoning``, ``Terminal.reasoning``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from coda.errors import InvalidRequestError

if TYPE_CHECKING:  # NOTE: only the type: this module stays pure Python at run time
    import tokenizers

OPEN_MARKER = "<think>"
CLOSE_MARKER = "</think>"


@dataclass(frozen=True)
class ReasoningSpec:
    """One request's reasoning markers, fixed at admission.

    ``inside``: the prompt ends inside a reasoning block (the output starts in the reasoning).
    ``close_ids``: the token ids that spell the closer (what a budget forces).
    ``open_ids``: the opener's token id(s): when the prompt did not open the block, the output
    opens one exactly when its first token is one of them (token level, so an output without a
    block is answer from its first token: stop ids see it). Empty: decided on bytes.
    ``budget_tokens``: the reasoning budget, tokens selected inside the block before the closer
    is forced (None: no budget). Named as Anthropic's ``thinking.budget_tokens``, never
    ``max_tokens``: that is the output budget's one name (L4)."""

    open: bytes = OPEN_MARKER.encode()
    close: bytes = CLOSE_MARKER.encode()
    inside: bool = False
    close_ids: tuple[int, ...] = ()
    budget_tokens: int | None = None
    open_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReasoningSplit:
    """What the terminal records of a split (K2): the removed opener (empty when the prompt
    opened the block), how many bytes of reasoning the stream sent, the removed closer (empty
    when the block never closed), and whether the budget forced the closer."""

    opener: bytes
    reasoning_bytes: int
    closer: bytes
    forced: bool = False
    reasoning_tokens: int = 0


class Phase(Enum):
    OPENING = "opening"      # the output may still start with the opener
    REASONING = "reasoning"
    ANSWER = "answer"


class ReasoningSplitter:
    """Byte-level splitter of one output (see the module doc). :meth:`push` takes the next
    detokenized bytes and returns ``(reasoning, answer)``: bytes now safe to send as
    reasoning, and answer bytes (for the stop matcher). :meth:`finish` releases held bytes
    at the end of the output."""

    def __init__(self, spec: ReasoningSpec) -> None:
        self.spec = spec
        self.phase = Phase.REASONING if spec.inside else Phase.OPENING
        self._held = b""            # possible opener / closer prefix, not yet sent
        self.opener = b""
        self.closer = b""
        self.reasoning_bytes = 0

    def no_block(self) -> None:
        """The output's first token is not the opener: no reasoning block (all answer)."""
        assert self.phase is Phase.OPENING and not self._held
        self.phase = Phase.ANSWER

    @property
    def held(self) -> int:
        """Bytes waiting as a possible marker prefix."""
        return len(self._held)

    @property
    def in_reasoning(self) -> bool:
        return self.phase is Phase.REASONING

    def push(self, data: bytes) -> tuple[bytes, bytes]:
        if self.phase is Phase.ANSWER:
            return b"", data
        window = self._held + data
        self._held = b""
        if self.phase is Phase.OPENING:
            marker = self.spec.open
            if window.startswith(marker):
                self.opener, self.phase = marker, Phase.REASONING
                window = window[len(marker):]
            elif marker.startswith(window):
                self._held = window  # NOTE: may still become the opener: wait
                return b"", b""
            else:
                self.phase = Phase.ANSWER  # NOTE: no reasoning block in this output
                return b"", window
        at = window.find(self.spec.close)
        if at >= 0:
            self.closer, self.phase = self.spec.close, Phase.ANSWER
            reasoning = window[:at]
            self.reasoning_bytes += len(reasoning)
            return reasoning, window[at + len(self.spec.close):]
        keep = _prefix_len(window, self.spec.close)
        reasoning, self._held = window[:len(window) - keep], window[len(window) - keep:]
        self.reasoning_bytes += len(reasoning)
        return reasoning, b""

    def finish(self) -> tuple[bytes, bytes]:
        """The output ended: held bytes are what they are (a partial opener is answer text, a
        partial closer reasoning text)."""
        held, self._held = self._held, b""
        if self.phase is Phase.OPENING:
            self.phase = Phase.ANSWER
            return b"", held
        if self.phase is Phase.REASONING:
            self.reasoning_bytes += len(held)
            return held, b""
        return b"", held

    def discard(self) -> bytes:
        """Cancel or failure (seed §4.3): a held marker prefix is never sent, so it is neither
        reasoning nor answer; drop it (the reasoning byte count stays what the stream sent)."""
        held, self._held = self._held, b""
        return held

    def split(self, *, forced: bool = False, tokens: int = 0) -> ReasoningSplit | None:
        """The terminal's record; None when the output had no reasoning block."""
        if not self.opener and not self.spec.inside:
            return None
        return ReasoningSplit(self.opener, self.reasoning_bytes, self.closer, forced, tokens)


def _prefix_len(data: bytes, marker: bytes) -> int:
    """Length of the longest suffix of ``data`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(data)), 0, -1):
        if data.endswith(marker[:n]):
            return n
    return 0


def marker_ids(tokenizer: tokenizers.Tokenizer) -> tuple[int, int] | None:
    """The (opener, closer) ids when the vocabulary has both as decodable, non-special
    tokens; None otherwise (no split: a special marker would be skipped by the detokenizer)."""
    ids = tokenizer.token_to_id(OPEN_MARKER), tokenizer.token_to_id(CLOSE_MARKER)
    if ids[0] is None or ids[1] is None:
        return None
    added = tokenizer.get_added_tokens_decoder()
    if any(i in added and added[i].special for i in ids):
        return None
    return ids[0], ids[1]


def reasoning_spec(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], *,
                   budget: int | None, budget_field: str) -> ReasoningSpec | None:
    """The request's :class:`ReasoningSpec`, or None when the model has no markers. A budget
    for a model without markers is a 400 naming ``budget_field``. A grammar (structured
    output, tools) changes nothing here: it constrains the answer only, from the closer on
    (the engine holds it back while the block may open or is open: ``EngineCore``)."""
    ids = marker_ids(tokenizer)
    if ids is None:
        if budget is not None:
            raise InvalidRequestError(
                f"{budget_field}: this model has no reasoning markers ({OPEN_MARKER}, "
                f"{CLOSE_MARKER})", field=budget_field)
        return None
    open_id, close_id = ids
    last_open = _last(prompt_ids, open_id)
    return ReasoningSpec(inside=last_open > _last(prompt_ids, close_id), close_ids=(close_id,),
                         budget_tokens=budget, open_ids=(open_id,))


def _last(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
