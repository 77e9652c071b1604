"""Batched token choice with a per-request, counter-based RNG (SPEC T4, L7, O1).

Contract of :meth:`Sampler.sample`: given logits ``[B, V]`` for ``B`` requests and one
:class:`SamplingRow` per request, return one :class:`TokenDecision` per row. The math is
vectorised over the batch; per-row Python only builds index tensors. Order of processing:

    raw logits ── repetition / frequency / presence penalties ── logit_bias
               ── mask (grammar mask, EOS ban while output < min_tokens)
               ── temperature ── top-k ── top-p ── min-p ── choose

Truncation is by value, so tied tokens are kept or dropped together (top-k may keep more than
k on a tie); :meth:`Sampler.process` exposes the processed logits for tests and debugging.

Greedy rows (``params.is_greedy``) take the argmax of the processed logits, which is the argmax
of the penalised, biased, masked logits (truncation always keeps the best token); they go
through the pipeline at temperature 1 so that ``prob`` is still a meaningful confidence.

Randomness (T4 "RNG cursor"): see :mod:`coda.engine.rng`. A sampled row draws one counter
uniform ``u`` of (seed, step) and picks, by inverse CDF, the first token (in id order) whose
cumulative probability under ``softmax(processed_logits)`` reaches ``u`` times the total.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from coda.engine.rng import row_keys, uniforms_at
from coda.errors import ModelError
from coda.sampling import SamplingParams

_NEG_INF = float("-inf")


def _draw(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF token per row of processed logits ``x`` [S, V] (-inf = not allowed).

    One counter uniform per row (the module docstring's ``u`` at counter 0): the token is the
    first whose cumulative probability reaches ``u`` times the row's total. A token with zero
    probability never starts a new cumulative value, so it can never be chosen. Row-wise
    softmax and cumsum do not depend on the other rows, so neither does the choice (T4)."""
    u = uniforms_at(keys, torch.zeros((keys.shape[0], 1), dtype=torch.int64,
                                       device=x.device))
    cdf = torch.softmax(x, dim=-1).cumsum_(dim=-1)
    target = u * cdf[:, -1:]
    # NOTE: u < 1 strictly and > 0, so 0 < target <= total: the index is always a live token.
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=x.shape[1] - 1)


def _row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(-1)``: each row's maximum and the index of its FIRST maximal value (the
    greedy choice; a NaN row gives a NaN maximum, which the caller rejects). On a float32
    CPU tensor by numpy's vectorised argmax, which keeps that rule: torch's ``max(-1)`` with
    indices runs ~2 ns a logit on one core, ~0.1 ms a row of a 49k vocabulary, about half the
    sampler's cost per row (a verification samples every drafted row; issue 21)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] == 0:
        return x.max(-1)
    tokens = torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))
    return x.gather(1, tokens[:, None]).squeeze(1), tokens


@dataclass(frozen=True)
class SamplingRow:
    """One request at one step. ``step`` is the 0-based index t of the token being chosen and is
    the RNG counter; ``seed`` is resolved at submit (random when ``params.seed`` is None).
    ``eos_token_ids`` are banned while ``len(output_token_ids) < params.min_tokens`` (whether EOS
    stops the request, ``ignore_eos``, is the loop's business). ``allowed_token_ids_mask`` is a
    bool ``[V]`` tensor from a grammar; None allows every token."""

    params: SamplingParams
    seed: int
    step: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    allowed_token_ids_mask: torch.Tensor | None = None


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class TokenDecision:
    """The record of one choice (trace O1, logprobs API, confidence for early stop).

    ``logprob`` and ``top_logprobs`` are under the model's raw distribution (log_softmax of the
    raw logits); ``prob`` is the chosen token's probability under the final processed one."""

    token_id: int
    logprob: float
    prob: float
    top_logprobs: tuple[tuple[int, float], ...]
    greedy: bool

    def to_record(self) -> dict[str, object]:
        """JSON-able dict for the trace; non-finite floats (a -inf logprob) become None."""
        return {
            "token_id": self.token_id,
            "logprob": _finite_or_none(self.logprob),
            "prob": _finite_or_none(self.prob),
            "top_logprobs": [[tid, _finite_or_none(lp)] for tid, lp in self.top_logprobs],
            "greedy": self.greedy,
        }


def _flat_ids(id_lists: Sequence[Sequence[int]], vocab: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors for every id of every row; ids outside [0, vocab) dropped."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    # NOTE: an id the logits cannot express cannot be penalised either; ignoring it is exact.
    keep = (flat >= 0) & (flat < vocab)
    return rows[keep].to(device), flat[keep].to(device)


def _penalise(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only); in place."""
    batch, vocab = x.shape
    rep = [r.params.repetition_penalty for r in rows]
    if any(v != 1.0 for v in rep):
        seen_lists = [list(r.prompt_token_ids) + list(r.output_token_ids) if v != 1.0 else []
                      for r, v in zip(rows, rep, strict=True)]
        r_idx, t_idx = _flat_ids(seen_lists, vocab, x.device)
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=x.device)
        seen[r_idx, t_idx] = True
        penalty = torch.tensor(rep, dtype=x.dtype, device=x.device)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    pres = [r.params.presence_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    if any(pres) or any(freq):
        out_lists = [r.output_token_ids if (p or f) else ()
                     for r, p, f in zip(rows, pres, freq, strict=True)]
        r_idx, t_idx = _flat_ids(out_lists, vocab, x.device)
        counts = torch.zeros(batch, vocab, dtype=x.dtype, device=x.device)
        counts.index_put_((r_idx, t_idx), torch.ones_like(t_idx, dtype=x.dtype), accumulate=True)
        freq_t = torch.tensor(freq, dtype=x.dtype, device=x.device)[:, None]
        pres_t = torch.tensor(pres, dtype=x.dtype, device=x.device)[:, None]
        x = x - freq_t * counts - pres_t * (counts > 0).to(x.dtype)
    return x


def _add_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    triples = [(i, tid, b) for i, r in enumerate(rows) for tid, b in r.params.logit_bias]
    if not triples:
        return x
    vocab = x.shape[1]
    if any(tid >= vocab for _, tid, _ in triples):
        raise ModelError(f"logit_bias names a token id >= vocabulary size {vocab}")
    r_idx, t_idx, bias = zip(*triples, strict=True)
    index = (torch.tensor(r_idx, device=x.device), torch.tensor(t_idx, device=x.device))
    return x.index_put(index, torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)


def _allowed(rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor | None:
    """Bool ``[B, V]`` of allowed tokens, or None when every token of every row is allowed."""
    bans = [(i, e) for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens
            for e in sorted(r.eos_token_ids) if 0 <= e < vocab]
    masks = [r.allowed_token_ids_mask for r in rows]
    if not bans and all(m is None for m in masks):
        return None
    allowed = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
    for i, mask in enumerate(masks):
        if mask is not None:
            if mask.shape != (vocab,):
                raise ModelError(f"row {i}: mask shape {tuple(mask.shape)} != ({vocab},)")
            allowed[i] = mask.to(device=device, dtype=torch.bool)
    if bans:
        banned = allowed.clone()
        b_rows, b_ids = zip(*bans, strict=True)
        banned[torch.tensor(b_rows, device=device), torch.tensor(b_ids, device=device)] = False
        # NOTE: min_tokens never overrides the grammar: if only EOS is allowed, EOS stays allowed.
        allowed = torch.where(banned.any(-1, keepdim=True), banned, allowed)
    return allowed


_TOP_P_WINDOW = 256  # NOTE: top-p first looks at the 256 best tokens; a full sort is the fallback.


def _top_k_top_p_floor(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Per-row value threshold ``[B, 1]`` of top-k then top-p (on the top-k survivors).

    Value-based, so ties never depend on the sort's tie-break (nor on the window, hence on the
    neighbours, T4): top-k keeps ``x >= (k-th best value)``; top-p keeps each value whose
    strictly-better mass is < p. Tokens are read from a window of the ``width`` best values;
    a row whose nucleus might extend past the window retries with the whole vocabulary."""
    vocab, device = x.shape[1], x.device
    k_eff = [k if 0 < k < vocab else vocab for k in ks]
    k_t = torch.tensor(k_eff, device=device)[:, None]
    p_t = torch.tensor(ps, dtype=x.dtype, device=device)[:, None]
    no_p = p_t >= 1.0  # NOTE: p = 1 must not trip on cumsum rounding.
    widths = [k for k in k_eff if k < vocab]
    if any(k == vocab and p < 1.0 for k, p in zip(k_eff, ps, strict=True)):
        widths.append(min(_TOP_P_WINDOW, vocab))
    width = max(widths, default=1)
    while True:
        vals = torch.topk(x, width, dim=-1).values  # sorted, best first
        ranks = torch.arange(width, device=device)[None, :]
        kth = vals.gather(1, (k_t - 1).clamp(max=width - 1))
        kth = torch.where(k_t >= vocab, _NEG_INF, kth)
        if all(p >= 1.0 for p in ps):
            return kth  # NOTE: top-k alone: no mass to add up (the general path gives the same)
        best = vals[:, :1]
        denominator = torch.exp(x - best).masked_fill(x < kth, 0.0).sum(-1, keepdim=True)
        probs = torch.exp(vals - best).masked_fill((ranks >= k_t) | (vals < kth), 0.0)
        probs = probs / denominator
        before = torch.cumsum(probs, dim=-1) - probs  # NOTE: mass strictly before each position
        before[:, 0] = 0.0
        # NOTE: the best token always survives, even when p underflows to 0 in x's dtype
        keep = (ranks < k_t) & ((before < p_t) | no_p | (ranks == 0))
        if width == vocab or not bool((keep[:, -1:] & (k_t >= vocab) & ~no_p).any()):
            break
        # NOTE: some nucleus reaches the window's edge: widen (x4) and redo exactly.
        width = min(vocab, width * 4)
    floor = vals.gather(1, keep.sum(-1, keepdim=True) - 1)
    return torch.where((k_t >= vocab) & no_p, _NEG_INF, floor)


def _truncate(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """top-k, then top-p, then min-p; removed tokens become -inf."""
    ks = [r.params.top_k for r in rows]
    ps = [r.params.top_p for r in rows]
    if any(k > 0 for k in ks) or any(p < 1.0 for p in ps):
        x = x.masked_fill(x < _top_k_top_p_floor(x, ks, ps), _NEG_INF)
    min_ps = [r.params.min_p for r in rows]
    if any(min_ps):
        probs = torch.softmax(x, dim=-1)
        floor = probs.amax(-1, keepdim=True) * torch.tensor(min_ps, device=x.device)[:, None]
        x = x.masked_fill(probs < floor, _NEG_INF)
    return x


class Sampler:
    """Stateless: every call is a pure function of (logits, rows); see the module docstring.
    Neither method modifies the caller's logits."""

    def _shaped(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ModelError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        # NOTE: no copy for float32 input: every step below is out of place.
        return logits.to(torch.float32)

    def _mask(self, raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Penalties, bias and mask; ``raw`` itself when none applies."""
        x = _add_bias(_penalise(raw, rows), rows)
        allowed = _allowed(rows, raw.shape[1], raw.device)
        return x if allowed is None else x.masked_fill(~allowed, _NEG_INF)

    @staticmethod
    def _raise_bad(raw: torch.Tensor, best: torch.Tensor) -> None:
        """``best``: row maxima after masking; NaN or -inf there means an unusable row."""
        bad = ~(best > _NEG_INF)  # NOTE: one reduction catches NaN (max propagates it) and -inf
        if bool(bad.any()):
            if bool(torch.isnan(raw).any()):
                raise ModelError("logits contain NaN")
            dead = bad.nonzero().flatten().tolist()
            raise ModelError(f"rows {dead}: no token is allowed (mask or logits all -inf)")

    @staticmethod
    def _temper(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        temps = [1.0 if r.params.is_greedy else r.params.temperature for r in rows]
        if all(t == 1.0 for t in temps):
            return x
        return x / torch.tensor(temps, device=x.device)[:, None]

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The processed float32 logits ``[B, V]`` that :meth:`sample` chooses from: penalised,
        biased, masked, divided by the temperature (1 for greedy rows) and truncated; a token
        that may not be chosen is -inf. Raises ModelError on bad shapes, NaN or an empty row."""
        raw = self._shaped(logits, rows)
        if bool(torch.isnan(raw).any()):
            raise ModelError("logits contain NaN")
        x = self._mask(raw, rows)
        self._raise_bad(raw, x.amax(-1))
        return _truncate(self._temper(x, rows), rows)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[TokenDecision]:
        """One decision per row, in row order (the module docstring gives the pipeline)."""
        if not rows and logits.dim() == 2 and logits.shape[0] == 0:
            return []
        raw = self._shaped(logits, rows)
        x = self._mask(raw, rows)
        # NOTE: truncation always keeps the best token, so this argmax is the greedy choice.
        best, tokens = _row_max(x)
        self._raise_bad(raw, best)
        x = _truncate(self._temper(x, rows), rows)
        device = x.device
        greedy = [r.params.is_greedy for r in rows]
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled:
            keys = row_keys([rows[i].seed for i in sampled], [rows[i].step for i in sampled],
                             device)
            index = torch.tensor(sampled, device=device)
            tokens[index] = _draw(x.index_select(0, index), keys)

        logprob_t, raw_lse = _raw_logprobs(raw, tokens)
        # NOTE: one logsumexp per row instead of a softmax; x is raw when nothing processed it.
        prob_t = (logprob_t if x is raw
                  else x.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(x, -1)).exp()
        logprob, prob = logprob_t.tolist(), prob_t.tolist()
        top = _top_logprobs(raw, raw_lse, [r.params.logprobs or 0 for r in rows])
        return [TokenDecision(tok, logprob[i], prob[i], top[i], greedy[i])
                for i, tok in enumerate(tokens.tolist())]

    def score(self, logits: torch.Tensor, token_ids: Sequence[int],
              k: int) -> list[TokenDecision]:
        """The record of each given token under its row of raw logits (prompt scoring, O1):
        what :meth:`sample` reports for that token had it chosen it (the same operations on
        the row: log_softmax of the raw logits and the ``k`` best), whatever the row's
        processing; ``prob`` is under the raw distribution and ``greedy`` is False."""
        raw = logits.to(torch.float32)
        if raw.dim() != 2 or raw.shape[0] != len(token_ids):
            raise ModelError(f"logits shape {tuple(raw.shape)} does not match "
                             f"{len(token_ids)} tokens")
        if not token_ids:
            return []
        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=raw.device)
        logprob_t, raw_lse = _raw_logprobs(raw, tokens)
        logprob = logprob_t.tolist()
        top = _top_logprobs(raw, raw_lse, [k] * len(token_ids))
        return [TokenDecision(tok, logprob[i], math.exp(logprob[i]), top[i], False)
                for i, tok in enumerate(token_ids)]


def _raw_logprobs(raw: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``tokens`` logprob under log_softmax(raw), and the rows' logsumexp: ONE
    home for the values a token's record reports (chosen or scored)."""
    raw_lse = torch.logsumexp(raw, -1)
    if bool(torch.isnan(raw_lse).any()):  # NOTE: a NaN the mask hid from `best`
        raise ModelError("logits contain NaN")
    return raw.gather(1, tokens[:, None]).squeeze(1) - raw_lse, raw_lse


def _top_logprobs(raw: torch.Tensor, raw_lse: torch.Tensor,
                  wanted: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Each row's ``wanted[i]`` best (token, logprob) pairs under log_softmax(raw): the first
    ``wanted[i]`` tokens by (logit descending, id ascending), the greedy pick's tie rule."""
    top: list[tuple[tuple[int, float], ...]] = [()] * len(wanted)
    for i, w in enumerate(wanted):
        if w > 0:
            top[i] = _row_top(raw[i], raw_lse[i], min(w, raw.shape[1]))
    return top


def _row_top(row: torch.Tensor, lse: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    # NOTE: torch.topk breaks ties among equal logits by k and by the batch (T4): take every
    # token above the k-th value, then the lowest ids equal to it, so the pairs depend only on
    # the row and k
    kth = row.topk(k).values[-1]
    above = (row > kth).nonzero().flatten()
    tied = (row == kth).nonzero().flatten()[: k - above.numel()]
    ids = torch.cat([above, tied])
    # NOTE: the logprob in float32 as the chosen token's own (same value, same bits)
    ranked = sorted(zip(row[ids].tolist(), ids.tolist(), (row[ids] - lse).tolist(), strict=True),
                    key=lambda p: (-p[0], p[1]))
    return tuple((t, lp) for _, t, lp in ranked)
