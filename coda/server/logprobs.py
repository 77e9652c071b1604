"""Token logprobs in the OpenAI shapes (chat ``content`` entries, legacy completions arrays,
Responses ``logprobs``), rendered from the events alone: each :class:`~coda.stream.TokenInfo`
carries its exact bytes in context (``piece``, computed by the engine), so the server needs no
tokenizer. A token holding half a UTF-8 character is shown with U+FFFD but its ``bytes`` are
exact; a SentencePiece token ``▁x`` is `` x`` (its leading space is part of it in the output).

A special token the request skips is an entry with no bytes (see :func:`chat_entries`; the
legacy arrays keep its text but do not move ``text_offset``).

Tokens are reported with the delta that carried their LAST byte (K2: an entry never shows
bytes the client has not received; a token whose first bytes went out while its last ones were
held as a possible stop start waits). Tokens no delta carried (``Terminal.trailing_tokens``: a
last token without visible text, bytes held at the end) are reported with the final chunk,
except when the request ended on EOS or a stop sequence: then they are the stop itself, which
never reaches the client (S3) — all but the first ``Terminal.trailing_shown``: text a stop
string starting inside a token cut, reported cut to the text. At a budget end the trailing
tokens come without the partial character the end removed (K3; ``coda.output_delta.cut_tail``).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping
from typing import Any

from coda.finish import FinishReason, Terminal
from coda.stream import TokenInfo, shown_piece


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _entry(raw: bytes, logprob: float | None) -> dict[str, Any]:
    return {"token": _text(raw), "logprob": logprob if logprob is not None else 0.0,
            "bytes": list(raw)}


def _alternatives(t: TokenInfo) -> list[tuple[bytes, float]]:
    return [(raw, lp) for raw, (_, lp) in zip(t.top_pieces, t.top_logprobs, strict=True)]


def chat_entries(tokens: Iterable[TokenInfo], *, skip_special: bool) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries (also the Responses and Ollama ``logprobs`` items).

    Each entry's ``token`` / ``bytes`` are the token's bytes in the returned text, so the
    entries reassemble it exactly: a special token the request skips (``skip_special_tokens``,
    the default) adds no text, so its entry is ``token: ""``, ``bytes: []`` (its logprob and
    alternatives stand); not skipped, it is its text (K2)."""
    out = []
    for t in tokens:
        e = _entry(shown_piece(t, skip_special), t.logprob)
        e["top_logprobs"] = [_entry(raw, lp) for raw, lp in _alternatives(t)]
        out.append(e)
    return out


def legacy_logprobs(tokens: Iterable[TokenInfo], start: int, end: int, *,
                    skip_special: bool = True) -> dict[str, Any]:
    """Legacy completions ``logprobs`` for the ``tokens`` of one delta whose text spans
    characters ``[start, end)`` of the choice's text (offsets clamped into that span).

    A special token the request skips (``skip_special_tokens``) adds no text, so it does not
    move the offset: ``[".", "<|endoftext|>", "user"]`` has offsets ``[0, 1, 1]``.

    Each ``top_logprobs`` entry is the ``k`` best, then the token itself where it is not among
    them (a sampled or a prompt token): OpenAI's "The API will always return the logprob of the
    sampled token, so there may be up to logprobs+1 elements", as vLLM does. Keys are token
    texts, so tokens with the same text (byte tokens of split characters, each U+FFFD) share
    one key, which holds the best of their logprobs: the greedy token's key is the top one
    (lm-eval's ``is_greedy``)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    # NOTE: offsets count the characters the text's bytes so far decode to (as the text was
    # decoded): a token holding part of a character starts at that character, and the 1-char
    # U+FFFD its ``tokens`` entry shows does not move the offset one character per byte
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = start
    for t in tokens:
        text = _text(t.piece)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        top: dict[str, float] = {}
        for raw, lp in _alternatives(t):  # NOTE: best first: a shared key keeps the best
            top.setdefault(_text(raw), lp)
        if t.logprob is not None and all(i != t.token_id for i, _ in t.top_logprobs):
            top.setdefault(text, t.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(min(offset, end))
        offset += len(decoder.decode(shown_piece(t, skip_special)))
    return out


def merge_legacy(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                              "text_offset": []}
    for p in parts:
        for k in merged:
            merged[k].extend(p[k])
    return merged


def reported_trailing(terminal: Terminal) -> tuple[TokenInfo, ...]:
    """The trailing tokens a client sees logprobs for (see the module docstring)."""
    if terminal.finish_reason in (FinishReason.EOS, FinishReason.STOP_SEQUENCE):
        return terminal.trailing_tokens[:terminal.trailing_shown]  # NOTE: never the stop's own
    return terminal.trailing_tokens
