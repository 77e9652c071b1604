"""Public request/engine types of the batched engine (pure Python, no torch).

:class:`GenerationRequest` is what the HTTP layer (or a Python user) submits; it is validated
once by the engine at submit time. :class:`EngineConfig` is normalised once and frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coda.early_stop import EarlyStopPolicy
from coda.reasoning import ReasoningSpec
from coda.sampling import SamplingParams
from coda.stream_backpressure import BackpressureConfig


@dataclass(frozen=True)
class GrammarSpec:
    """Constrained decoding request (issue 5): exactly one of the fields is set.

    - ``json_schema``: a JSON schema (dict); ``json_object`` any JSON object;
    - ``regex``: a regular expression the whole output must match;
    - ``lark``: a Lark grammar (llguidance dialect).

    ``close_within_budget`` (issue 13, :mod:`coda.engine.closure`): steer to a short completion
    when the budget is about to run out mid-structure; None = the default, on for
    ``json_schema`` (tool grammars set it on). ``trigger``: the string that opens an *optional*
    constrained part of a lark grammar (a tool call's opening tag under ``auto``); the closer
    counts output that ends inside it as that part begun (:mod:`coda.engine.closure`).
    """

    json_schema: dict[str, object] | None = None  # NOTE: the client's JSON, as parsed
    json_object: bool = False
    regex: str | None = None
    lark: str | None = None
    close_within_budget: bool | None = None
    trigger: str | None = None

    @property
    def closes_within_budget(self) -> bool:
        if self.close_within_budget is not None:
            return self.close_within_budget
        return self.json_schema is not None


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request in token space (checked once, by :func:`coda.engine.plan.plan_request`).

    ``max_tokens`` is the token budget under its one name (every protocol's spelling is mapped
    onto it at parse); None means the engine's ``EngineConfig.default_max_tokens`` where that
    ends before the context, else "up to the context limit"; :data:`coda.engine.plan.NO_LIMIT`
    (-1) is "up to the context limit" whatever the default (a protocol's "no limit", Ollama's
    unset ``num_predict``): either way reaching the context ends ``context_limit``; 0 prefills the prompt only: the
    request ends ``max_output_tokens`` with no token (prompt scoring, with ``prompt_logprobs``).
    ``deadline_s`` is relative to submit;
    past it the request ends ``deadline_exceeded`` (G3). ``stop_token_ids`` are id sequences
    (a single id is a sequence of length one). ``stops_end_at`` (a tool call's opening tag):
    stop strings are matched only before and through it, never inside the call (issue 13)."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    deadline_s: float | None = None
    early_stop: EarlyStopPolicy | None = None
    grammar: GrammarSpec | None = None
    backpressure: BackpressureConfig | None = None
    request_id: str | None = None
    utf8_tail: str = "auto"  # K3 tail policy: "auto" | "fail" | "drop" (coda.output)
    # stop strings apply only up to the end of this text's first occurrence (coda.output.OutputSpec)
    stops_end_at: str | None = None
    # issue 23: split the reasoning block off the answer (coda.reasoning), with its budget
    reasoning: ReasoningSpec | None = None
    # issue 21: False opts this request out of the server's speculative decoding
    speculative: bool = True
    # echo: score every prompt token in the prefill, with this many alternatives (0..20;
    # None: no scoring); the terminal carries them (coda.engine.plan, Terminal.prompt_logprobs)
    prompt_logprobs: int | None = None
    # OpenAI's chat ``prediction`` as token ids (None: none sent): drafted from where the
    # engine can verify exactly, and counted against the output (coda.engine.prediction)
    prediction: tuple[int, ...] | None = None
    # P1: the start event is written when the engine admits the request (its first prefill
    # chunk scheduled), not at submit, so the log itself says whether it still waits for a
    # slot (a background response's ``queued`` / ``in_progress``, coda.server.responses_object)
    start_at_admission: bool = False


class EngineConfigError(ValueError):
    """An :class:`EngineConfig` value that no engine can run with (named at construction, before
    any weight is read); ``field`` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


# NOTE: the counts that must be whole and positive (None: the default policy where allowed);
# 0 or a negative one failed late as a ZeroDivisionError, torch's RuntimeError, a misleading
# "KV cache budget is smaller than one block", or (default_max_tokens) silently meant "up to
# the context"
_POSITIVE = ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk",
             "default_max_tokens", "max_stop_string_bytes")
_POSITIVE_OR_NONE = ("num_blocks", "kv_cache_bytes", "max_model_len", "num_threads")
_NON_NEGATIVE = ("max_stop_strings", "recent_traces", "max_forward_retries")


# NOTE: the modes of EngineConfig.speculative (coda.engine.speculative; draft: coda.engine.draft)
SPECULATIVE_MODES = ("off", "prompt-lookup", "draft")


def _check_counts(config: EngineConfig) -> None:
    for name in _POSITIVE + _POSITIVE_OR_NONE + _NON_NEGATIVE:
        value = getattr(config, name)
        if value is None and name in _POSITIVE_OR_NONE:
            continue
        low = 0 if name in _NON_NEGATIVE else 1
        # NOTE: bool is an int subclass: max_model_len=True was a context of "True tokens"
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise EngineConfigError(f"EngineConfig.{name} must be an integer >= {low}"
                                    + (" or None" if name in _POSITIVE_OR_NONE else "")
                                    + f", got {value!r}", field=name)


def _check_choices(config: EngineConfig) -> None:
    """The KV fraction and the speculative mode: refused as the counts are (they were a plain
    ValueError, the fraction's only after the weights had loaded)."""
    frac = config.kv_cache_memory_fraction
    # NOTE: NaN fails both comparisons; a bool is no fraction
    if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float))
                             or not 0 < frac <= 1):
        raise EngineConfigError("EngineConfig.kv_cache_memory_fraction (--kv-cache-fraction) "
                                f"must be in (0, 1] or None, got {frac!r}",
                                field="kv_cache_memory_fraction")
    if config.speculative not in SPECULATIVE_MODES:
        raise EngineConfigError(f"unknown --speculative {config.speculative!r} (EngineConfig."
                                f"speculative); modes: {', '.join(SPECULATIVE_MODES)}",
                                field="speculative")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs, normalised once.

    KV cache size: ``num_blocks`` or ``kv_cache_bytes`` exactly, else
    ``kv_cache_memory_fraction`` of the memory available after the weights, else
    ``max_num_seqs`` full contexts capped by ``memory_budget`` (weights + KV; ``"8GiB"``,
    ``"40%"``…; default half the memory available at start) less the weights
    (``coda/engine/kv_budget.py``). The cache is reserved, and committed as it is written.
    ``max_model_len`` caps the context below the model's own (one above it is capped to it,
    with a warning at load: :meth:`served_context`); ``num_threads`` None keeps the
    runner's thread policy (``coda/engine/runner.py``).

    ``quant``: the serving mode (``coda/models/modes.py``; docs/quantization.md): ``"auto"``
    (a GGUF: the fastest batch-invariant mode this machine runs; an HF folder: dense float32),
    ``"fp32"`` (exact), ``"bf16"``, ``"fp16"``, ``"q4"``, ``"q4-int8head"``. ``dtype``, when
    given, names a dense mode by its dtype (``"bfloat16"`` is ``quant="bf16"``).

    A count no engine can run with (``block_size``, ``max_num_seqs``, ``default_max_tokens``…
    below 1; ``num_threads`` / ``max_model_len`` / ``num_blocks`` / ``kv_cache_bytes`` below 1
    unless None; a negative ``max_stop_strings`` / ``recent_traces`` / ``max_forward_retries``; a bool), a
    ``kv_cache_memory_fraction`` outside (0, 1] or an unknown ``speculative`` mode raises
    :class:`EngineConfigError` when the config is built (SPEC E1: refused before any work);
    so does :meth:`AsyncEngine.from_model_dir` for a ``speculative`` / ``draft_model`` pair
    that contradicts itself or a mode the load cannot run exactly."""

    quant: str = "auto"
    dtype: str | None = None
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    memory_budget: str | None = None
    max_model_len: int | None = None
    num_threads: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    enable_prefix_caching: bool = True
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    default_max_tokens: int = 256
    max_forward_retries: int = 1
    trace_path: str | None = None
    # issue 13: keep the trace rows of this many recent requests in memory (0: off); the
    # server's playground reads them through GET /v1/traces/{id}. ``coda serve`` turns it on.
    recent_traces: int = 0
    served_model_name: str | None = None
    # issue 21: "prompt-lookup" drafts from each request's own tokens and verifies the drafts
    # in the same step (coda.engine.speculative); refused where the mode is not batch-invariant
    speculative: str = "off"
    # issue 21 item 2: a draft model (anything ``model`` takes) sharing the tokenizer; implies
    # speculative="draft" (coda.engine.draft)
    draft_model: str | None = None

    def __post_init__(self) -> None:
        _check_counts(self)  # NOTE: raises EngineConfigError (a ValueError) naming the field
        _check_choices(self)

    def served_context(self, model_context: int) -> int:
        """The context served for a model of ``model_context`` tokens: ``max_model_len`` caps
        it, never raises it (a larger one is capped, with a warning at load)."""
        return min(model_context, self.max_model_len or model_context)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    num_requests_total: int
    num_preemptions_total: int
    # NOTE: issue 19 item 3: the cache's mapping, and the part of it ever written (committed)
    kv_cache_reserved_bytes: int = 0
    kv_cache_committed_bytes: int = 0
    # NOTE: embeddings' chunks run so far, and those dropped at a chunk boundary (caller gone)
    embed_chunks_total: int = 0
    embeds_cancelled_total: int = 0
