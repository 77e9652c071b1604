"""RoPE frequencies: the one place they are computed (issue 19 item 1; SPEC T3).

:func:`inv_freq` turns a :class:`~coda.models.config.ModelConfig` into the inverse frequencies of
its rotated dimensions (``rope_dim / 2`` values, float32) and :func:`cos_sin_scale` into the
factor cos and sin are multiplied by. Every source resolves to these through
:mod:`coda.models.rope_scaling`: an HF folder's ``rope_scaling`` (llama3, linear, dynamic,
yarn, longrope) and a GGUF file's metadata and factor tensors (``rope_freqs.weight``: Llama 3's scaling as per-frequency
divisors; ``rope_factors_long``/``rope_factors_short``: LongRoPE's). The formulas follow
transformers' (``modeling_rope_utils``), which is the oracle of the tests; llama.cpp divides
each frequency by its file factor, the same numbers.

This module imports torch; the model (``llama.py``) builds its cos/sin tables from it.
"""

from __future__ import annotations

import math

import torch

from coda.models.config import ModelConfig
from coda.models.rope_scaling import RopeScaling


def _base(theta: float, dim: int) -> torch.Tensor:
    """``theta ** (2i / dim)`` for the ``dim / 2`` frequencies, float32 (transformers' order:
    an int64 arange cast to float)."""
    # NOTE: on CPU even under a meta-device init (the model keeps it as a plain attribute)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return theta ** exponent


def inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies ``[rope_dim / 2]`` in float32, the config's scaling applied
    (``local``: Gemma 3's local layers, base ``rope_local_theta`` and never scaled)."""
    dim = cfg.rope_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    rs = None if local else cfg.rope_scaling
    if rs is not None and rs.kind in ("longrope", "freq_factors"):
        factors = rs.long_factor if rs.kind == "longrope" and rs.long else rs.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"{len(factors)} RoPE factors for {dim // 2} frequencies")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * _base(theta, dim))
    if rs is not None and rs.kind == "yarn":
        return _yarn(rs, theta, dim)
    inv = 1.0 / _base(theta, dim)
    if rs is None or rs.kind == "dynamic":
        return inv  # NOTE: dynamic NTK is the identity within max_context (see config.py)
    if rs.kind == "linear":
        return inv / rs.factor
    return _llama3(rs, inv)


def cos_sin_scale(cfg: ModelConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by (yarn's and LongRoPE's attention factor; else 1)."""
    rs = None if local else cfg.rope_scaling
    return rs.attention_factor if rs is not None else 1.0


def _llama3(rs: RopeScaling, inv: torch.Tensor) -> torch.Tensor:
    """Llama 3: long wavelengths divided by ``factor``, short kept, a smooth blend between."""
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(rs: RopeScaling, theta: float, dim: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept,
    with a linear ramp over the dimensions between."""
    def dim_at(rotations: float) -> float:
        orig = rs.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_at(rs.beta_fast), dim_at(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: a one-point ramp would divide by zero
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((index - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # NOTE: the share of the unscaled (extrapolated) frequency
    pos = _base(theta, dim)
    return (1.0 / (rs.factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x``: [T, H, d]; ``cos``/``sin_signed``: [T, 1, r] (HF's non-interleaved half rotation
    of the first ``r`` dimensions; the other ``d - r`` pass through: partial rotary, Phi-4).

    ``sin_signed`` is ``sin`` with its first half negated, so HF's ``rotate_half(x) * sin`` =
    ``cat(-x2, x1) * sin`` becomes ``cat(x2, x1) * sin_signed`` (a sign flip is exact)."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin_signed), x[..., rot:]), dim=-1)
    half = rot // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed
