"""A linear's native call with its weights' pointers resolved once (issue 18 item 3): what the
fused decoder loop (``coda/models/native_loop.py``) calls instead of the ``direct()`` wrapper,
which checks ``x``, allocates ``y`` and reads the weights' pointers on every call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ATTR = "raw"  # NOTE: the attribute a direct() call carries its RawLinear under


@dataclass(frozen=True)
class RawLinear:
    """``fn(x_ptr, M, *args, y_ptr)`` computes ``y[M, out_features] = x[M, in_features] @ W.T``
    into caller-owned contiguous float32 buffers, the same call (the same bits) as the module's
    ``direct()``; ``keep`` holds the tensors whose pointers ``args`` carry."""

    fn: Callable[..., None]
    args: tuple[Any, ...]
    in_features: int
    out_features: int
    keep: tuple[torch.Tensor, ...] = ()


def attach(call: Callable[[torch.Tensor], torch.Tensor], raw: RawLinear) -> None:
    """Hang ``raw`` on a ``direct()`` call (read back by :func:`raw_of`)."""
    setattr(call, ATTR, raw)


def raw_of(call: Any) -> RawLinear | None:
    """The :class:`RawLinear` a plan's projection carries; None for any other callable (a
    ``functools.partial(F.linear)``, or a profiler's timing wrapper that attached none)."""
    raw = getattr(call, ATTR, None)
    return raw if isinstance(raw, RawLinear) else None
