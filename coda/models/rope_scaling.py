"""RoPE scaling as a checkpoint states it, resolved into :class:`RopeScaling` (issue 19 item 1;
SPEC T3). Torch-free: :mod:`coda.models.config` (HF ``rope_scaling`` / ``rope_parameters``,
``partial_rotary_factor``) and :mod:`coda.models.gguf_file` (llama.cpp's ``rope.scaling.*``
keys and factor tensors) parse here; :mod:`coda.models.rope` turns the result into
frequencies, the one place they are computed.

Every value transformers derives is resolved at parse time (yarn's and LongRoPE's attention
factor, LongRoPE's factor from the context lengths, Phi-3's ``su``/``yarn`` read as LongRoPE),
so both sources give the model the same numbers. A GGUF states Llama 3's scaling as
``rope_freqs.weight`` (per-frequency divisors: kind ``freq_factors``) and LongRoPE's as the
``rope_factors_short``/``rope_factors_long`` tensors; yarn knobs transformers has no meaning
for (``yarn_ext_factor`` other than 1, ``yarn_log_multiplier``) are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from coda.models.load_errors import UnsupportedModelError

# RoPE factor tensors of a GGUF: read into the config, never into the weights.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, resolved to the numbers :mod:`coda.models.rope` needs.

    ``kind``: ``llama3``, ``linear``, ``dynamic``, ``yarn``, ``longrope`` or ``freq_factors``
    (llama.cpp's ``rope_freqs.weight``: per-frequency divisors, which is how a GGUF stores
    Llama 3's scaling).

    ``dynamic`` (NTK) only changes frequencies for sequences longer than
    ``original_max_position_embeddings``; :attr:`ModelConfig.max_context` never exceeds that
    length for it, so within our context it is exactly the unscaled RoPE. ``longrope`` picks
    its short factors for sequences up to ``original_max_position_embeddings`` and its long
    ones beyond (per whole sequence, in transformers): a paged cache cannot switch a
    sequence's keys midway, so ``long`` chooses one set for the model's life — short (the
    default: the context is capped at the original length, exactly transformers' numerics
    there) or long (the whole context, transformers' numerics for sequences past the original
    length; llama.cpp's choice when its context exceeds it).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # NOTE: cos and sin are multiplied by it (yarn's mscale, LongRoPE's sqrt(1 + ln s / ln L))
    attention_factor: float = 1.0
    beta_fast: float = 32.0  # yarn: the ramp's ends, in rotations over the original context
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope's short factors; freq_factors' divisors
    long_factor: tuple[float, ...] = ()  # longrope's long factors
    long: bool = False  # longrope: serve with the long factors (see above)


def parse_hf_rope(d: dict[str, Any], arch: str = "llama") -> tuple[float, RopeScaling | None]:
    """Return ``(rope_theta, scaling)`` from either the hub style or transformers v5 style,
    with every value transformers derives (yarn's and LongRoPE's attention factor, LongRoPE's
    factor from the context lengths) resolved here."""
    params = d.get("rope_parameters")
    scaling_dict = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling_dict = scaling_dict or params
    theta = float(theta if theta is not None else 10000.0)
    if not scaling_dict:
        return theta, None
    kind = scaling_dict.get("rope_type") or scaling_dict.get("type") or "default"
    if arch == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # NOTE: transformers reads Phi-3's su/yarn configs as LongRoPE
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear", "dynamic", "yarn", "longrope"):
        raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}; supported: "
                                    "llama3, linear, dynamic, yarn, longrope")
    max_pos = int(d.get("max_position_embeddings", 2048))
    # NOTE: as transformers: a top-level original_max_position_embeddings (Phi-3) wins, then
    # the scaling dict's, then max_position_embeddings (dynamic NTK always uses the latter).
    orig = int(max_pos if kind == "dynamic" else d.get("original_max_position_embeddings")
               or scaling_dict.get("original_max_position_embeddings") or max_pos)
    factor = scaling_dict.get("factor")
    if kind == "yarn":
        return theta, _yarn(scaling_dict, max_pos, orig)
    if kind == "longrope":
        return theta, _longrope(scaling_dict, max_pos, orig)
    return theta, RopeScaling(
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(scaling_dict.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_dict.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=orig,
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_attention_factor(scale: float, orig: int) -> float:
    """LongRoPE's default attention factor for a context ``scale`` times the original ``orig``
    positions: sqrt(1 + ln(scale) / ln(orig)) (1 when not extended)."""
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))


def _yarn(sd: dict[str, Any], max_pos: int, orig: int) -> RopeScaling:
    factor = float(sd["factor"]) if sd.get("factor") is not None else max_pos / orig
    attn = sd.get("attention_factor")
    if attn is None:
        mscale, all_dim = sd.get("mscale"), sd.get("mscale_all_dim")
        attn = (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
                if mscale and all_dim else yarn_mscale(factor))
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=orig,
                       attention_factor=float(attn),
                       beta_fast=float(sd.get("beta_fast") or 32.0),
                       beta_slow=float(sd.get("beta_slow") or 1.0),
                       truncate=bool(sd.get("truncate", True)))


def _longrope(sd: dict[str, Any], max_pos: int, orig: int) -> RopeScaling:
    short, long = sd.get("short_factor"), sd.get("long_factor")
    if not isinstance(short, list) or not isinstance(long, list):
        raise UnsupportedModelError("longrope scaling needs short_factor and long_factor lists")
    attn = sd.get("attention_factor")
    scale = float(sd["factor"]) if sd.get("factor") else max_pos / orig
    if attn is None:
        attn = longrope_attention_factor(scale, orig)
    return RopeScaling(kind="longrope", factor=scale,
                       original_max_position_embeddings=orig, attention_factor=float(attn),
                       short_factor=tuple(float(x) for x in short),
                       long_factor=tuple(float(x) for x in long))


def hf_rotary_dim(d: dict[str, Any], arch: str, head_dim: int,
                scaling: RopeScaling | None) -> int | None:
    """Phi-3's ``partial_rotary_factor`` as a number of dimensions (None: all of head_dim);
    LongRoPE's factors must cover exactly the rotated half-dimensions."""
    params = d.get("rope_parameters")
    prf = d.get("partial_rotary_factor")
    if prf is None and isinstance(params, dict):
        prf = params.get("partial_rotary_factor")
    rot = int(head_dim * float(prf)) if prf is not None else head_dim
    if rot != head_dim and arch != "phi3":
        raise UnsupportedModelError(f"partial rotary ({rot} of {head_dim}) is supported for "
                                    f"phi3 only, not {arch}")
    if rot <= 0 or rot % 2:
        raise UnsupportedModelError(f"rotary dimension {rot} must be even and positive")
    if scaling is not None and scaling.kind == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(getattr(scaling, name)) != rot // 2:
                raise UnsupportedModelError(f"longrope {name} has {len(getattr(scaling, name))}"
                                            f" values; the rotary dimension {rot} needs {rot // 2}")
    return None if rot == head_dim else rot


def rope_factor_values(names: set[str], values: dict[str, tuple[float, ...]],
                        rope_dim: int) -> dict[str, tuple[float, ...]]:
    """The file's RoPE factor tensors by name, each ``rope_dim / 2`` values."""
    out: dict[str, tuple[float, ...]] = {}
    for name in ROPE_TENSORS:
        if name not in names:
            continue
        if name not in values:
            raise UnsupportedModelError(f"GGUF tensor {name!r} could not be read")
        if len(values[name]) != rope_dim // 2:
            raise UnsupportedModelError(f"GGUF tensor {name!r} has {len(values[name])} values; "
                                        f"the rotary dimension {rope_dim} needs {rope_dim // 2}")
        out[name] = values[name]
    return out


def gguf_rope_scaling(get: Any, ctx: int, factors: dict[str, tuple[float, ...]],
                  arch: str) -> RopeScaling | None:
    """The file's RoPE scaling (see the module docstring); anything else is refused."""
    kind = get("rope.scaling.type", "none", required=False)
    orig = int(get("rope.scaling.original_context_length", ctx, required=False))
    freqs = factors.get("rope_freqs.weight")
    long, short = factors.get("rope_factors_long.weight"), factors.get("rope_factors_short.weight")
    if kind == "longrope" or (kind in ("none", None) and long is not None):
        if long is None or short is None:
            raise UnsupportedModelError("GGUF longrope scaling without rope_factors_long and "
                                        "rope_factors_short tensors")
        attn = get("rope.scaling.attn_factor", None, required=False)
        return RopeScaling(
            kind="longrope", factor=ctx / orig, original_max_position_embeddings=orig,
            attention_factor=float(attn) if attn is not None
            else longrope_attention_factor(ctx / orig, orig),
            short_factor=short, long_factor=long)
    if long is not None or short is not None:
        raise UnsupportedModelError(f"GGUF LongRoPE factor tensors with rope scaling {kind!r}")
    if freqs is not None:
        if kind not in ("none", None):
            raise UnsupportedModelError(f"GGUF rope_freqs.weight with rope scaling {kind!r}")
        # NOTE: Llama 3's scaling as llama.cpp stores it: each frequency divided by its factor
        return RopeScaling(kind="freq_factors", factor=1.0,
                           original_max_position_embeddings=orig, short_factor=freqs)
    if kind in ("none", None):
        return None
    factor = float(get("rope.scaling.factor", 1.0, required=False))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor, original_max_position_embeddings=orig)
    if kind != "yarn":
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported "
                                    "(linear, yarn, longrope, rope_freqs)")
    ext = get("rope.scaling.yarn_ext_factor", None, required=False)
    log_mul = get("rope.scaling.yarn_log_multiplier", None, required=False)
    if (ext is not None and float(ext) not in (-1.0, 1.0)) or (log_mul is not None and
                                                               float(log_mul) != 0.0):
        raise UnsupportedModelError(f"GGUF yarn with ext_factor {ext} / log multiplier "
                                    f"{log_mul} is not supported")
    attn = get("rope.scaling.yarn_attn_factor", None, required=False)
    if attn is None:
        attn = get("rope.scaling.attn_factor", None, required=False)
    return RopeScaling(
        kind="yarn", factor=factor, original_max_position_embeddings=orig,
        attention_factor=float(attn) if attn is not None else yarn_mscale(factor),
        beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
        beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)))
