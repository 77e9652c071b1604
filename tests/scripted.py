"""A scripted model, chooser and tokenizer for exact event-order tests (used *in addition* to
the real model, never instead of it). Pure Python, no torch.

``scripted_tokenizer({101: b"AB", 102: b"CD"})`` builds a real ``tokenizers.Tokenizer`` (a
byte-level BPE whose vocabulary maps each scripted id to its bytes), so the real incremental
detokenizer runs on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import tokenizers

from coda.output import OutputSpec
from coda.stream import TokenInfo
from tests.reference_loop import Choice

EOS_ID = 0


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map used by ByteLevel."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def scripted_tokenizer(table: Mapping[int, bytes], eos_id: int = EOS_ID,
                       added: Mapping[int, str] | None = None) -> tokenizers.Tokenizer:
    """A byte-level tokenizer whose id ``i`` decodes to ``table[i]``; ``eos_id`` is ``<eos>``.
    ``added``: non-special added tokens (id → content), as Qwen3 declares ``<think>`` and
    ``</think>`` (issue 23)."""
    alphabet = _byte_alphabet()
    vocab = {"".join(alphabet[b] for b in data): i for i, data in table.items()}
    if len(vocab) != len(table):
        raise ValueError("two ids share the same bytes")
    vocab["<eos>"] = eos_id
    extra = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": False} for i, text in (added or {}).items()]
    for i, text in (added or {}).items():
        vocab[text] = i
    spec: dict[str, object] = {
        "version": "1.0",
        "added_tokens": [{"id": eos_id, "content": "<eos>", "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True}] + extra,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "dropout": None,
                  "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False},
    }
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@dataclass
class ScriptedModel:
    """Returns, as "logits", the id scripted for the next step. ``hooks`` run inside
    ``decode_one`` at a given step t (between decode.started(t) and decode.completed(t)), e.g.
    to inject a cancel (experiment B) or raise a model error."""

    script: Sequence[int]
    hooks: dict[int, Callable[[], None]] = field(default_factory=dict)
    fail_at: int | None = None
    calls: list[tuple[str, int]] = field(default_factory=list)
    released: int = 0
    _step: int = 0

    def prefill(self, token_ids: Sequence[int]) -> int:
        self.calls.append(("prefill", len(token_ids)))
        self._step = 0
        return self.script[0]

    def decode_one(self, token_id: int, position: int) -> int:
        self._step += 1
        t = self._step
        self.calls.append(("decode", position))
        if t in self.hooks:
            self.hooks[t]()
        if self.fail_at == t:
            raise RuntimeError(f"injected failure at step {t}")
        return self.script[t]

    def release(self) -> None:
        self.released += 1


class ScriptedChooser:
    """Chooses exactly the scripted id; the decision record says so."""

    def choose(self, logits: int, step: int, output_ids: Sequence[int]) -> Choice:
        return Choice(int(logits), TokenInfo(int(logits), 0.0),
                      {"rule": "scripted", "step": step})


def output_spec(**kw: object) -> OutputSpec:
    """An :class:`~coda.output.OutputSpec` with the scripted tests' defaults (50 tokens, a
    1000-token context, a 2-token prompt, EOS = :data:`EOS_ID`), overridden by ``kw``."""
    base: dict[str, object] = dict(max_tokens=50, eos_token_ids=frozenset({EOS_ID}))
    base.update(kw)
    return OutputSpec(**base)  # type: ignore[arg-type]


class ManualClock:
    """A monotonic clock that only the test advances (``now``); see :class:`TickingModel`."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class TickingModel(ScriptedModel):
    """A scripted model whose every decode step advances ``clock`` by one second (P5)."""

    clock: ManualClock

    def decode_one(self, token_id: int, position: int) -> int:
        self.clock.now += 1.0
        return super().decode_one(token_id, position)
