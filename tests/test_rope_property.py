"""For all RoPE scalings (issue 19 item 1; SPEC T3): Coda's one frequency function equals
transformers' own (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``, the oracle) on the frequencies
and the cos/sin attention factor, for llama3, linear, yarn (with or without betas, attention
factor and truncation) and LongRoPE (short and long, partial rotary); and llama.cpp's way of
storing Llama 3 scaling (per-frequency divisors, ``rope_freqs.weight``) gives the same
frequencies."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.config import ModelConfig
from coda.models.rope import cos_sin_scale, inv_freq
from coda.models.rope_scaling import RopeScaling
from tests.conftest import examples
from tests.test_rope_families import coda_divisors, converter_divisors

THETAS = st.sampled_from([10000.0, 500000.0, 1e6])
ORIGS = st.sampled_from([32, 64, 4096, 8192])
FACTORS = st.floats(1.25, 32.0)


def _oracle(kind: str, d: dict[str, Any], long: bool = False) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls = Phi3Config if d["architectures"] == ["Phi3ForCausalLM"] else LlamaConfig
    keys = ("hidden_size", "num_attention_heads", "max_position_embeddings", "rope_theta",
            "rope_scaling", "partial_rotary_factor", "original_max_position_embeddings")
    cfg = cls(**{k: d[k] for k in keys if k in d})
    seq = cfg.rope_parameters["original_max_position_embeddings"] + 1 if long else None
    inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq)
    return inv, float(scale)


def _hf(head_dim: int, theta: float, max_pos: int, rope_scaling: dict[str, Any],
        **extra: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 4 * head_dim,
            "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 8,
            "vocab_size": 8, "max_position_embeddings": max_pos, "rope_theta": theta,
            "rope_scaling": rope_scaling, **extra}


def _check(d: dict[str, Any], kind: str, long: bool = False) -> ModelConfig:
    cfg = ModelConfig.from_hf_dict(d)
    if long:
        assert cfg.rope_scaling is not None
        cfg = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling,
                                                                        long=True))
    want, scale = _oracle(kind, d, long)
    torch.testing.assert_close(inv_freq(cfg), want.float(), rtol=1e-6, atol=0)
    assert abs(cos_sin_scale(cfg) - scale) <= 1e-12 * max(1.0, scale)
    return cfg


@settings(max_examples=examples(40), deadline=None)
@given(head_dim=st.sampled_from([16, 32, 64, 128]), theta=THETAS, orig=ORIGS, factor=FACTORS,
       low=st.floats(0.5, 2.0), high=st.floats(2.5, 8.0))
def test_t3_llama3_frequencies_equal_transformers_and_llamacpp_divisors(
        head_dim: int, theta: float, orig: int, factor: float, low: float, high: float) -> None:
    """llama3: Coda's frequencies are transformers'; llama.cpp's divisors (its converter's
    formula) divide the unscaled frequencies into the same ones, and so do Coda's."""
    rs = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
          "high_freq_factor": high, "original_max_position_embeddings": orig}
    cfg = _check(_hf(head_dim, theta, 4 * orig, rs), "llama3")
    assert cfg.rope_scaling is not None
    for divisors in (converter_divisors(theta, head_dim, rs),
                     coda_divisors(cfg)):
        from_file = dataclasses.replace(cfg, rope_scaling=RopeScaling(
            kind="freq_factors", factor=1.0, short_factor=tuple(divisors)))
        # NOTE: the divisors are computed in float64 (as llama.cpp's converter does), the config's
        # frequencies in float32 (as transformers does); near the low-frequency edge
        # `old / wavelen - low` cancels in float32, and a README run found 2.06e-6 there.
        torch.testing.assert_close(inv_freq(from_file), inv_freq(cfg), rtol=1e-5, atol=0)


@settings(max_examples=examples(40), deadline=None)
@given(head_dim=st.sampled_from([16, 64, 128]), theta=THETAS, orig=ORIGS, factor=FACTORS,
       betas=st.none() | st.tuples(st.floats(8.0, 64.0), st.floats(0.5, 4.0)),
       attn=st.none() | st.floats(0.5, 2.0), truncate=st.booleans(),
       kind=st.sampled_from(["yarn", "linear"]))
def test_t3_yarn_and_linear_equal_transformers(head_dim: int, theta: float, orig: int,
                                               factor: float, betas: tuple[float, float] | None,
                                               attn: float | None, truncate: bool,
                                               kind: str) -> None:
    """yarn (betas, attention factor, truncation as the config says or transformers'
    defaults) and linear: the frequencies and the cos/sin factor are transformers'."""
    rs: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        rs.update(original_max_position_embeddings=orig, truncate=truncate)
        if betas is not None:
            rs.update(beta_fast=betas[0], beta_slow=betas[1])
        if attn is not None:
            rs.update(attention_factor=attn)
    _check(_hf(head_dim, theta, int(orig * factor), rs), kind)


@settings(max_examples=examples(30), deadline=None)
@given(head_dim=st.sampled_from([16, 32, 96, 128]), prf=st.sampled_from([1.0, 0.75, 0.5]),
       theta=THETAS, orig=ORIGS, times=st.integers(1, 32), long=st.booleans(),
       seed=st.integers(0, 2**16))
def test_t3_longrope_short_and_long_equal_transformers(head_dim: int, prf: float, theta: float,
                                                       orig: int, times: int, long: bool,
                                                       seed: int) -> None:
    """Phi-3's LongRoPE with partial rotary: the short factors (what transformers uses up to
    the original context) and the long ones (past it) give transformers' frequencies and
    attention factor (derived from the context lengths)."""
    rot = int(head_dim * prf)
    gen = torch.Generator().manual_seed(seed)
    short = (1 + torch.rand(rot // 2, generator=gen)).tolist()
    longf = (1 + 30 * torch.rand(rot // 2, generator=gen)).tolist()
    d = _hf(head_dim, theta, orig * times, {"type": "longrope", "short_factor": short,
                                            "long_factor": longf},
            architectures=["Phi3ForCausalLM"], partial_rotary_factor=prf,
            original_max_position_embeddings=orig)
    cfg = _check(d, "longrope", long)
    assert cfg.rope_dim == rot and cfg.max_context == (orig * times if long else orig)
