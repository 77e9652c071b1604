"""One served model of a several-model server, seen from the server (issue 23 item 1).

A :class:`ModelSlot` holds what the HTTP layer needs without the weights — the resolved
source, its names, the tokenizer and chat template (read from the checkpoint: the GGUF header
or the folder's tokenizer files), the context, and what Ollama's ``/api/show`` and
``/api/tags`` describe (architecture, parameter count, stored type: from the same header or
``config.json``, so a model not loaded yet is described all the same) — and, while loaded, its
:class:`~coda.engine.process_engine.WorkerProcess`. The weights live only in the worker.

Memory (``--memory-budget``, weights + KV in one budget): a model's footprint is its weight
files' size plus its KV cache — estimated before a load as the KV rule's ceiling within the
model's share, then the bytes the worker reports having allocated.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import tokenizers

from coda.engine.kv_budget import DEFAULT_KV_MEMORY_FRACTION
from coda.engine.process_engine import WorkerProcess
from coda.engine.protocol import ModelInfo
from coda.engine.types import EngineConfig
from coda.models.identity import ModelIdentity
from coda.models.source import ModelSource, model_key, resolve_model
from coda.models.tokenizer_bundle import TokenizerBundle
from coda.server.model_specs import ModelSpec


@dataclass
class ModelSlot:
    spec: ModelSpec
    source: ModelSource
    name: str
    aliases: frozenset[str]
    chat: TokenizerBundle
    context_length: int
    weight_bytes: int
    config: EngineConfig
    kv_available: int | None = None  # NOTE: the model's share minus its weights (a budget)
    worker: WorkerProcess | None = None
    identity: ModelIdentity | None = None  # NOTE: known once loaded (P1: computed at load)
    # NOTE: architecture, parameters, quantization: from the header (describe), then the worker's
    info: ModelInfo | None = None
    live: set[str] = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tokenizer(self) -> tokenizers.Tokenizer:
        return self.chat.tokenizer

    @property
    def pinned(self) -> bool:
        return self.spec.pinned

    @property
    def status(self) -> str:
        """``unloaded`` | ``loading`` | ``loaded``."""
        w = self.worker
        if w is None:
            return "unloaded"
        return "loaded" if w.state == "ready" else "loading"

    def kv_bytes(self) -> int:
        """The KV cache: as allocated when loaded, else the rule's ceiling (an estimate)."""
        w = self.worker
        if w is not None and "kv_cache_bytes" in w.info:
            return int(w.info["kv_cache_bytes"])
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.kv_available is not None:
            frac = self.config.kv_cache_memory_fraction or DEFAULT_KV_MEMORY_FRACTION
            return int(frac * self.kv_available)
        return 0

    def footprint(self) -> int:
        return self.weight_bytes + self.kv_bytes()

    def idle(self) -> bool:
        """Nothing of it in flight: it may be unloaded."""
        w = self.worker
        return not self.live and (w is None or w.num_open == 0)


def describe(spec: ModelSpec, config: EngineConfig) -> ModelSlot:
    """Resolve ``spec`` and read its tokenizer and context without loading weights. Raises
    :class:`~coda.models.config.ModelLoadError` (or ValueError) like a load would."""
    from coda.models.config import ModelConfig
    from coda.models.tokenizer_bundle import bundle_from_gguf, bundle_from_hf_dir

    source = resolve_model(spec.model)
    if source.kind == "gguf":
        from coda.models.gguf_file import open_gguf

        ckpt = open_gguf(source.path)
        bundle, mc = bundle_from_gguf(ckpt), ckpt.config
        weights = source.path.stat().st_size
        stored = ckpt.quantization  # NOTE: the header's file type (as the loaded model says)
    else:
        mc = ModelConfig.from_dir(source.path)
        bundle = bundle_from_hf_dir(source.path, mc)
        weights = sum(p.stat().st_size for p in source.path.glob("*.safetensors"))
        stored = mc.torch_dtype
    name = spec.name or source.name
    context = config.served_context(mc.max_context)
    cfg = replace(config, served_model_name=name)
    info = ModelInfo(name, context, bundle.eos_token_ids, architecture=mc.arch,
                     parameters=mc.num_parameters, quantization=stored,
                     modified=source.modified)
    return ModelSlot(spec, source, name, source.aliases | {model_key(name)}, bundle, context,
                     weights, cfg, info=info)
