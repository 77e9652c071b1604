"""The counter-based RNG of the sampler (SPEC T4 "RNG cursor", L7).

Randomness (T4 "RNG cursor"): a sampled row draws one uniform ``u = u[0]`` and picks, by
inverse CDF, the first token (in id order) whose cumulative probability under
``softmax(processed_logits)`` reaches ``u`` times the total. The uniforms are a pure function of
``(seed, step, v)`` (``counter_uniforms`` exposes the whole stream; the draw uses counter 0):

    key  = mix64(mix64(seed) XOR step)                (seed taken mod 2**64)
    h[v] = mix64(key + (v + 1) * GAMMA)               (splitmix64's stream, counter v + 1)
    u[v] = ((h[v] >>> 41) + 0.5) / 2**23              (23 bits: exact in float32, never 0 or 1)

``mix64`` is the splitmix64 finaliser, computed in wrapping int64 torch ops (``>>>`` is emulated
with a shift and a mask). No generator state exists, so a request's draw is independent of its
batch neighbours, row index, arrival order and preemption: resuming at the same ``step`` with
the same logits yields the same token. A request's whole RNG state is its cursor ``(seed,
step)`` (``EngineRequest.rng_seed`` / ``rng_step`` in coda.engine.engine_request), the ``rng_state``
resource its lifecycle holds (L7).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    """The int64 with the same low 64 bits as ``value`` (torch has no uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MUL1 = _signed64(0xBF58476D1CE4E5B9)
_MUL2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, shift: int) -> torch.Tensor:
    # NOTE: torch's >> on int64 is arithmetic; masking off the sign-extended bits makes it logical.
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns (multiplications wrap mod 2**64)."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` in place, with one scratch tensor (the same integer ops, so the same bits).

    NOTE: at [32, 49152] the out-of-place version allocates ~15 fresh 12 MB tensors; page
    faults on those made it ~10x slower than the arithmetic."""
    tmp = torch.empty_like(x)
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1
        x ^= tmp
        if mul is not None:
            x *= mul
    return x


def row_keys(seeds: Sequence[int], steps: Sequence[int], device: torch.device | str) -> torch.Tensor:
    seed_t = torch.tensor([_signed64(s) for s in seeds], dtype=torch.int64, device=device)
    step_t = torch.tensor([_signed64(s) for s in steps], dtype=torch.int64, device=device)
    return mix64(mix64(seed_t) ^ step_t)


def uniforms_at(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``u`` of the module docstring at ``token_ids`` (``[S, n]`` for row keys ``[S]``, or
    ``[n]`` for per-element keys ``[n]``). In-place integer ops: the same bits as the formula."""
    bits = token_ids + 1
    bits *= _GAMMA
    bits += keys[:, None] if bits.dim() == 2 else keys
    _mix64_(bits)
    bits >>= 41
    bits &= (1 << 23) - 1
    # NOTE: 23 bits, so k + 0.5 is exact in float32's 24-bit mantissa and u < 1 strictly.
    u = bits.to(torch.float32)
    u += 0.5
    u *= 2.0**-23
    return u


def counter_uniforms(seeds: Sequence[int], steps: Sequence[int], vocab_size: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniforms in (0, 1), float32 ``[len(seeds), vocab_size]``; row i depends on (seeds[i], steps[i])."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device).expand(len(seeds), -1)
    return uniforms_at(row_keys(seeds, steps, device), ids)
