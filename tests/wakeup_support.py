"""A wake-up channel that records what producers post (issue 22 step 4): tests see every
``(stream, seq, final)`` a producer posted, on the producer's thread, without an event loop."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from coda.wakeup import WakeChannel


class PostLog(WakeChannel):
    """Records every post (and, with ``probe``, a value read at post time), then delivers it
    as the one channel does."""

    def __init__(self, probe: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.posts: list[tuple[int, bool]] = []
        self.probed: list[Any] = []
        self._probe = probe

    def post(self, source: Hashable, seq: int, *, final: bool = False) -> None:
        self.posts.append((seq, final))
        if self._probe is not None:
            self.probed.append(self._probe())
        super().post(source, seq, final=final)
