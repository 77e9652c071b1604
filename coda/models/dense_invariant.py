"""A float32 model made batch-invariant: every projection and the LM head through the native
in-place kernel (``fp32-kernel``, issue 18 item 2; T4). The kernel side is
:func:`coda.models.kernels.dense.dense_linear`; this is the model side, which the kernels
package does not import (it stays a leaf of ``coda.models``)."""

from __future__ import annotations

from torch import nn

from coda.models.config import ModelConfig
from coda.models.kernels import native
from coda.models.kernels.dense import LANE, dense_linear
from coda.models.llama import CausalLM


def unfit(cfg: ModelConfig) -> str | None:
    """Why :func:`make_invariant` cannot convert a model of ``cfg`` (None: it can)."""
    for name, k in (("hidden_size", cfg.hidden_size), ("intermediate_size",
                    cfg.intermediate_size), ("attention width", cfg.q_size)):
        if k % LANE:
            return f"{name} {k} is not a multiple of {LANE} (the invariant kernel's lanes)"
    return None


def make_invariant(model: CausalLM) -> CausalLM:
    """Replace every ``nn.Linear`` of the decoder layers and the LM head (tied or not) of a
    float32 ``model`` by :func:`dense_linear` layers on the same weights, in place; returns it.
    ``model.kernels`` says what runs where (the load summary)."""
    if (why := unfit(model.config)) is not None:
        raise ValueError(why)
    for path, module in list(model.model.layers.named_modules()):
        if type(module) is nn.Linear:
            model.model.layers.set_submodule(path, dense_linear(module.weight, module.bias))
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    model.logits_head = dense_linear(head)  # NOTE: a tied head reads the embedding table itself
    isa = native().isa()
    model.kernels = {"F32 projections and head": f"packed-f32/{isa} (in place)",
                     "F32 embeddings": "float32 table (row gather)"}
    model._plans.clear()  # NOTE: the layer plans hold the modules' calls; rebuild them
    return model
