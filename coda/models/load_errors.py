"""The errors a model load raises (one home: ``config.py``, the GGUF reader and the RoPE
parsers raise them; ``coda.models.config`` re-exports them for its callers)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names what is missing (the CLI prints it,
    never a stack trace)."""


class DraftModelLoadError(ModelLoadError):
    """The draft model (``--draft-model``, ``EngineConfig.draft_model``) cannot be loaded or
    does not fit the target; the message names it and the flag (it read as the target's)."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint this engine cannot run exactly (unknown architecture, RoPE type, GGUF
    tensor type or tokenizer)."""
