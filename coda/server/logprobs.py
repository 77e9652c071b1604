"""Token logprobs in the OpenAI shapes (chat ``content`` entries, legacy completions arrays,
Responses ``logprobs``). Tokens are shown by their own bytes (the detokenizer's byte view), so
a token holding half a UTF-8 character is shown with U+FFFD but its ``bytes`` are exact.

Tokens are reported with the delta that carried their bytes. Tokens no delta carried
(``Terminal.trailing_tokens``: a last token without visible text, bytes held at the end) are
reported with the final chunk, except when the request ended on EOS or a stop sequence: then
they are the stop itself, which never reaches the client (S3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coda.detokenizer import profile_of
from coda.finish import FinishReason
from coda.stream import Terminal, TokenInfo


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    view = profile_of(tokenizer).view(token_id)
    if isinstance(view, bytes):
        return view
    if isinstance(view, int) and view >= 0:
        return bytes([view])
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode()


def token_text(tokenizer: Any, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def _entry(tokenizer: Any, token_id: int, logprob: float | None) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", errors="replace"),
            "logprob": logprob if logprob is not None else 0.0, "bytes": list(raw)}


def chat_entries(tokenizer: Any, tokens: Iterable[TokenInfo]) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries (also the Responses ``logprobs`` items)."""
    out = []
    for t in tokens:
        e = _entry(tokenizer, t.token_id, t.logprob)
        e["top_logprobs"] = [_entry(tokenizer, i, lp) for i, lp in t.top_logprobs]
        out.append(e)
    return out


def legacy_logprobs(tokenizer: Any, tokens: Iterable[TokenInfo], start: int, end: int, *,
                    skip_special: bool = True) -> dict[str, Any]:
    """Legacy completions ``logprobs`` for the ``tokens`` of one delta whose text spans
    characters ``[start, end)`` of the choice's text (offsets clamped into that span).

    A special token the request skips (``skip_special_tokens``) adds no text, so it does not
    move the offset: ``[".", "<|endoftext|>", "user"]`` has offsets ``[0, 1, 1]``."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    skipped = profile_of(tokenizer).special_ids if skip_special else frozenset()
    offset = start
    for t in tokens:
        text = token_text(tokenizer, t.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({token_text(tokenizer, i): lp for i, lp in t.top_logprobs})
        out["text_offset"].append(min(offset, end))
        if t.token_id not in skipped:
            offset += len(text)
    return out


def merge_legacy(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                              "text_offset": []}
    for p in parts:
        for k in merged:
            merged[k].extend(p[k])
    return merged


def reported_trailing(terminal: Terminal) -> tuple[TokenInfo, ...]:
    """The trailing tokens a client sees logprobs for (see the module docstring)."""
    if terminal.finish_reason in (FinishReason.EOS, FinishReason.STOP_SEQUENCE):
        return ()
    return terminal.trailing_tokens
