"""The trace checker's preemption rules (SPEC T4, O1, L7): a request whose K/V the scheduler
dropped (``kv.preempted``) runs its model again only after it got blocks back
(``kv.reacquired``), which recomputes exactly the tokens it knows past the prefix cache's.
Used by :mod:`coda.trace_check` (the walk); the state is :class:`coda.trace_rules.Request`'s.

Neither row is a release or an acquisition of the ``kv_cache`` resource: the request keeps its
claim on the cache while it waits, and that resource is released once, at its ending (L7).
"""

from __future__ import annotations

from coda import trace as tr
from coda.trace_rules import Request

# the rows of a model step: none while the request's K/V is dropped (T4)
_STEP_KINDS = frozenset({tr.PREFILL_COMPLETED, tr.TOKEN_SELECTED, tr.DECODE_STARTED,
                         tr.DECODE_COMPLETED, tr.SPECULATIVE, tr.GRAMMAR_FORCED, tr.ERROR})
_RUNNING = ("PREFILLING", "DECODING")


def check_step_row(r: Request, ev: tr.TraceEvent) -> None:
    """A model step's row while the K/V is dropped: it ran on no cache (T4)."""
    if r.preempted and ev.kind in _STEP_KINDS:
        r.bad("T4", f"{ev.kind} while the request's K/V is preempted (no kv.reacquired)")


def on_preempted(r: Request, ev: tr.TraceEvent) -> None:
    d = ev.data
    if r.preempted:
        r.bad("T4", "a second kv.preempted before the K/V was reacquired")
    if "kv_cache" not in r.acquired_order or "kv_cache" in r.released_order:
        r.bad("L7", "kv.preempted while the request holds no KV cache")
    if r.state not in _RUNNING or r.prefill is None:
        r.bad("T4", f"kv.preempted while {r.state}, not between steps of a running request")
    if d.get("t") != r.selected:
        r.bad("T4", f"kv.preempted at t={d.get('t')!r} with {r.selected} selected")
    if d.get("preemption") != r.preemptions + 1:
        r.bad("T4", f"preemption {d.get('preemption')!r}, expected {r.preemptions + 1}")
    cache_len, blocks = d.get("cache_len"), d.get("blocks")
    prompt = r.prefill.data.get("tokens") if r.prefill is not None else None
    if not isinstance(blocks, int) or blocks < 0 or not isinstance(cache_len, int) or \
            cache_len < 0:
        r.bad("T4", f"kv.preempted drops {cache_len!r} tokens in {blocks!r} blocks")
    elif cache_len > 0 and blocks == 0:
        r.bad("T4", f"kv.preempted drops {cache_len} tokens in no block")
    elif isinstance(prompt, int) and r.state == "DECODING" and \
            cache_len != prompt + r.decoded:
        r.bad("T4", f"kv.preempted drops {cache_len} tokens; the cache held "
                    f"{prompt + r.decoded} (prompt + decoded)")
    elif isinstance(prompt, int) and r.state == "PREFILLING" and cache_len > prompt:
        r.bad("T4", f"kv.preempted drops {cache_len} tokens of a {prompt}-token prefill")
    r.preempted = True
    r.preemptions += 1


def on_reacquired(r: Request, ev: tr.TraceEvent) -> None:
    d = ev.data
    if not r.preempted:
        r.bad("T4", "kv.reacquired without a kv.preempted before it")
    if r.state not in _RUNNING:
        r.bad("T4", f"kv.reacquired while {r.state}")
    if d.get("t") != r.selected:
        r.bad("T4", f"kv.reacquired at t={d.get('t')!r} with {r.selected} selected")
    recompute, cached = d.get("recompute"), d.get("cached")
    prompt = r.prefill.data.get("tokens") if r.prefill is not None else None
    if not isinstance(recompute, int) or not isinstance(cached, int) or recompute < 1 \
            or cached < 0:
        r.bad("T4", f"kv.reacquired recomputes {recompute!r} tokens after {cached!r} cached")
    elif isinstance(prompt, int) and recompute + cached != prompt + r.selected:
        r.bad("T4", f"kv.reacquired: {recompute} recomputed + {cached} cached tokens is not "
                    f"the {prompt + r.selected} the request knows (prompt + selected)")
    r.preempted = False
