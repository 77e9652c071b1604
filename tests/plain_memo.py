"""Plain decoding's outcome, run once per reference engine and request list (issue 21's
oracle; SPEC T4): the speculative tests compare against plain decoding on the same model, and
several of them (parametrized over a draft, a config) ask the same engine for the same
requests. :func:`plain_run` runs them the first time and hands back that run's results after.

Sound because a plain engine without a prefix cache is a function of its requests (T4: the
same tokens, logprobs, text, finish reason and usage on every run, alone or in a crowd), which
every speculative test asserts anyway; with a prefix cache the usage would depend on what ran
before, so such an engine is refused. The memo lives as long as the engine (a module-scoped
fixture): nothing is shared between engines or modules.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import GenerationRequest
from tests.test_speculative import Result, _run

Key = tuple[str, bool]
Entry = tuple[tuple[GenerationRequest, ...], tuple[Result, ...]]

_MEMO: weakref.WeakKeyDictionary[AsyncEngine, dict[Key, Entry]] = weakref.WeakKeyDictionary()


def plain_run(engine: AsyncEngine, reqs: Sequence[GenerationRequest], crowd: bool = True
              ) -> list[Result]:
    """``_run(engine, reqs, crowd)``, computed once per engine, ``reqs`` and ``crowd``."""
    assert engine.speculative is None, "the reference is plain decoding"
    assert not engine.config.enable_prefix_caching, "usage would depend on earlier runs"
    # NOTE: a GrammarSpec holds a dict (unhashable): the key is the requests' repr, and a hit
    # must also be equal (so two different request lists can never share a result)
    key, want = (repr(tuple(reqs)), crowd), tuple(reqs)
    memo = _MEMO.setdefault(engine, {})
    hit = memo.get(key)
    if hit is None or hit[0] != want:
        hit = memo[key] = (want, tuple(_run(engine, reqs, crowd=crowd)))
    return list(hit[1])
