"""An embedding whose client left is cancelled on its replica too (SPEC C1; issue 12; the
single-process version: tests/test_embed_chunks.py, ``cancel_call`` for a worker process).

Through the ingress's engine (:class:`~coda.scaleout.remote.RemoteEngine`, what
``/v1/embeddings`` awaits with ``--replicas``): many embeddings are awaited at once, as many
clients would, and every awaiting task is cancelled while most still wait on the replicas.
Before, awaiting a Ray Serve response did not cancel it when the awaiting task was cancelled:
each replica ran every embedding to its end (0 dropped). Now the call is cancelled on the
replica, whose engine drops what it had not run (its ``embeds_cancelled_total``). The
session's two replicas (conftest ``replicas``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)
CALLS = 200


def test_cancelled_embeddings_are_dropped_on_their_replicas_c1(replicas: Any) -> None:
    """C1: of ``CALLS`` embeddings cancelled 0.5 s in, the replicas drop some (their engines
    count them) and run fewer than the rest; nothing is left running."""
    from coda.scaleout.remote import RemoteEngine

    engine = RemoteEngine(replicas.replicas, replicas.config)
    ids = [5, 6, 7, 8] * 120  # NOTE: one chunk each on the tiny model (in its vocabulary)
    before = engine.stats()

    async def leave_early() -> int:
        tasks = [asyncio.ensure_future(engine.embed(ids)) for _ in range(CALLS)]
        await asyncio.sleep(0.5)
        done = sum(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return done

    done = asyncio.run(leave_early())
    deadline = time.monotonic() + 60
    while True:  # NOTE: until the replicas' counts settle (their engines drain)
        a = engine.stats()
        time.sleep(2)
        b = engine.stats()
        if (a.embed_chunks_total, a.embeds_cancelled_total) == (
                b.embed_chunks_total, b.embeds_cancelled_total) or time.monotonic() > deadline:
            break
    ran = b.embed_chunks_total - before.embed_chunks_total
    dropped = b.embeds_cancelled_total - before.embeds_cancelled_total
    assert done < CALLS, "every embedding ended before the cancel: nothing was tested"
    assert dropped >= 1, (done, ran, dropped)
    assert ran < CALLS, (done, ran, dropped)
