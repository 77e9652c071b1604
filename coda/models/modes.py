"""Serving modes (``--quant``): how a model's weights are held and multiplied (issue 10; T4).

One table, :data:`QUANT_MODES`: a mode's name → :class:`QuantMode` (its GGUF builder, its
numerics in one line, whether a row's output is independent of the batch, and two checks:
whether this machine can run it, whether a given file can be served that way). Adding a mode
is one entry here plus its builder; :func:`resolve_mode` is the only place a mode is chosen.

``auto`` (the default) resolves to:

* an HF folder (or the embedded model): ``fp32-kernel`` (float32 weights through Coda's
  in-place kernel: batch-invariant, T4; issue 18 item 2, issue 20 D10) where the native module
  runs, else ``fp32`` (BLAS: a row's rounding depends on the batch, and the load summary says
  NOT batch-invariant);
* a GGUF file: the first mode of :data:`AUTO_ORDER` that is available here and applies to the
  file — the fastest batch-invariant mode, so that batching never changes a request's tokens
  (T4); a float GGUF ends at ``fp32-kernel`` — else ``fp32`` (exact, not invariant);
* with an explicit ``dtype`` (``--dtype``): the dense mode of that dtype, for either kind.

``--quant fp32`` stays plain ``F.linear`` (BLAS), the measured opt-out.
An explicit mode with an explicit ``dtype`` must run that dtype (``--quant q4 --dtype float32``
is fine: q4's activations are float32).

:func:`coda.models.backend.resolve_backend` is mode resolution as the loader uses it: the mode
with the decoder's row ops, one frozen value chosen once at load.

A mode that does not apply (``q4`` on an HF folder, or on a file whose projections are not
Q4_0/Q4_1; ``packed`` on a tensor type it has no kernel for), is not available on this machine, or contradicts ``dtype`` raises
:class:`~coda.models.config.UnsupportedModelError` / :class:`ModelLoadError` with one line
saying why; nothing is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from coda.models import kernels
from coda.models.config import DENSE_BY_DTYPE, ModelConfig, ModelLoadError, UnsupportedModelError
from coda.models.gguf_file import GGUFCheckpoint, open_gguf
from coda.models.identity import ModelIdentity, digest_files, model_identity
from coda.models.tokenizer_bundle import folder_chat_template

if TYPE_CHECKING:
    from coda.models.llama import CausalLM
    from coda.models.row_ops import RowOps

# NOTE: the builders import torch and the kernels inside their bodies, on purpose: this table
# is read by `coda models` and by mode resolution before any weight is loaded, without torch.


class Builder(Protocol):
    """(checkpoint, device, the backend's row ops) -> model."""

    def __call__(self, ckpt: GGUFCheckpoint, device: str,
                 rows: RowOps | None = None) -> CausalLM: ...


class FolderBuilder(Protocol):
    """(HF folder, device, row ops, the folder's config as served) -> model."""

    def __call__(self, path: Path, device: str, rows: RowOps | None = None,
                 config: ModelConfig | None = None) -> CausalLM: ...


Check = Callable[["GGUFCheckpoint"], "str | None"]  # None = applies; else why not


def _folder(dtype: str) -> FolderBuilder:
    def build(path: Path, device: str, rows: RowOps | None = None,
              config: ModelConfig | None = None) -> CausalLM:
        from coda.models.loader import load_model  # NOTE: torch (see the note above)

        return load_model(path, dtype=dtype, device=device, rows=rows, config=config)

    return build


def _applies_always(_: GGUFCheckpoint) -> str | None:
    return None


def _available_always() -> str | None:
    return None


@dataclass(frozen=True)
class QuantMode:
    """One serving mode. ``dtype`` is the activation and KV-cache dtype the runner uses;
    ``dense`` modes dequantize every tensor to ``dtype`` and also serve HF folders."""

    name: str
    numerics: str  # one line: what is exact and what is rounded (load summary, docs)
    batch_invariant: bool  # T4: a row's output is bit-identical whatever the batch
    dtype: str
    build_gguf: Builder
    dense: bool = False
    applies: Check = _applies_always  # can this file be served so? (None = yes)
    available: Callable[[], str | None] = _available_always  # can this machine? (None = yes)
    build_folder: FolderBuilder | None = None  # an HF folder's model (dense modes)
    native_matmuls: bool = False  # every matmul in coda._native (its one canonical order)

    def kernel_order(self) -> str:
        """The summation order of this mode's matmuls, for the model identity (P1): the
        native kernels' canonical order (the same bits on every machine), or torch's, which
        is per machine (:func:`coda.models.kernels.order`)."""
        return kernels.order(self.native_matmuls)

    def load_folder(self, path: Path, device: str, rows: RowOps | None = None,
                    config: ModelConfig | None = None) -> CausalLM:
        """This mode's model of the HF folder ``path`` (dense modes only)."""
        build = self.build_folder or _folder(self.dtype)
        return build(path, device, rows, config)

    def summary(self) -> dict[str, str | bool]:
        """The mode's part of the load summary, with the native kernels' state (the ISA that
        runs, or why they are missing and so which path runs instead)."""
        return {"quant_mode": self.name, "numerics": self.numerics,
                "batch_invariant": self.batch_invariant, "activation_dtype": self.dtype,
                **kernels.describe()}


def _dense(dtype: str) -> Builder:
    def build(ckpt: GGUFCheckpoint, device: str, rows: RowOps | None = None) -> CausalLM:
        from coda.models.gguf_weights import load_gguf_model  # NOTE: torch (see above)

        return load_gguf_model(ckpt, dtype=dtype, device=device, rows=rows)

    return build


def _packed(head: str) -> Builder:
    def build(ckpt: GGUFCheckpoint, device: str, rows: RowOps | None = None) -> CausalLM:
        from coda.models.gguf_packed import build_q4  # NOTE: torch (see above)

        return build_q4(ckpt, head=head, device=device, rows=rows)

    return build


def _ggml(act: str) -> Builder:
    def build(ckpt: GGUFCheckpoint, device: str, rows: RowOps | None = None) -> CausalLM:
        from coda.models.gguf_packed import build_ggml  # NOTE: torch (see above)

        return build_ggml(ckpt, act=act, device=device, rows=rows)

    return build


def _kernel_folder(path: Path, device: str, rows: RowOps | None = None,
                   config: ModelConfig | None = None) -> CausalLM:
    from coda.models.dense_invariant import make_invariant, unfit  # NOTE: torch (see above)
    from coda.models.loader import load_model

    cfg = config if config is not None else ModelConfig.from_dir(path)
    why = unfit(cfg) or (None if device == "cpu" else "the kernels run on the CPU only")
    if why is not None:
        raise UnsupportedModelError(f"--quant fp32-kernel cannot serve {path.name}: {why}")
    return make_invariant(load_model(path, dtype="float32", device=device, rows=rows,
                                     config=cfg))


def _kernel_gguf(ckpt: GGUFCheckpoint, device: str, rows: RowOps | None = None) -> CausalLM:
    from coda.models.dense_invariant import make_invariant  # NOTE: torch (see above)
    from coda.models.gguf_packed import build_ggml, float_applies
    from coda.models.gguf_weights import load_gguf_model

    if float_applies(ckpt) is None:  # NOTE: F32/F16/BF16 rows read in place from the file
        return build_ggml(ckpt, act="f32", device=device, floats=True, rows=rows)
    # NOTE: a quantized file asked for fp32-kernel (auto only lands here when packed and q4
    # refuse it): dequantized to float32 like fp32, multiplied by the invariant kernel
    return make_invariant(load_gguf_model(ckpt, dtype="float32", device=device, rows=rows))


def _kernel_applies(ckpt: GGUFCheckpoint) -> str | None:
    from coda.models.dense_invariant import unfit  # NOTE: torch (see above)

    return unfit(ckpt.config)


def _ggml_applies(ckpt: GGUFCheckpoint) -> str | None:
    from coda.models.gguf_packed import ggml_applies  # NOTE: torch (see above)

    return ggml_applies(ckpt)


def _ggml_kernel() -> str | None:
    return kernels.unavailable()  # NOTE: an import of the module built at install; never a compile


def _q4_applies(ckpt: GGUFCheckpoint) -> str | None:
    from coda.models.gguf_packed import q4_applies  # NOTE: torch (see above)

    return q4_applies(ckpt)


def _int4_kernel() -> str | None:
    import torch

    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu kernel"
    return None


QUANT_MODES: dict[str, QuantMode] = {m.name: m for m in (
    QuantMode("fp32", "every tensor dequantized to float32: exactly the file's weights; "
              "float32 activations", False, "float32", _dense("float32"), dense=True),
    QuantMode("fp32-kernel", "as fp32 (the file's weights exactly in float32; F16/BF16 GGUF "
              "rows read in place), multiplied by Coda's in-place kernel (fixed per-output "
              "summation order) instead of BLAS; float32 activations", True, "float32", _kernel_gguf, dense=True,
              applies=_kernel_applies, available=_ggml_kernel, build_folder=_kernel_folder,
              native_matmuls=True),
    QuantMode("bf16", "weights dequantized then rounded to bfloat16; bfloat16 activations "
              "and KV cache", False, "bfloat16", _dense("bfloat16"), dense=True),
    QuantMode("fp16", "weights dequantized then rounded to float16; float16 activations "
              "and KV cache", False, "float16", _dense("float16"), dense=True),
    QuantMode("q4", "Q4_0/Q4_1 projections packed for torch's int4 kernel (file's 4-bit codes "
              "exact; group scale/zero rounded to bfloat16; matmul inputs bfloat16); Q8_0 head "
              "as two exact int4 halves; embeddings, norms, RoPE, attention and KV float32",
              True, "float32", _packed("q8split"), applies=_q4_applies, available=_int4_kernel),
    QuantMode("packed", "every matrix (head included; Q4_0..Q8_0, Q2_K..Q6_K, F16/BF16/F32, "
              "mixed within a fused projection) on the file's own blocks through Coda's "
              "kernels: exact weights, float32 activations, fixed per-output summation order; "
              "embeddings gathered from the blocks; norms, RoPE, attention and KV float32",
              True, "float32", _ggml("f32"), applies=_ggml_applies, available=_ggml_kernel,
              native_matmuls=True),
    QuantMode("packed-q8", "as packed, with each row's activations quantized to int8 (lossy, "
              "like llama.cpp's CPU path): per block of 32 for Q4_0/Q4_1/Q8_0 matrices, to "
              "Q8_K (per 256) for K-quant ones (Q2_K..Q6_K); other types keep float32 "
              "activations", True, "float32", _ggml("q8"),
              applies=_ggml_applies, available=_ggml_kernel, native_matmuls=True),
    QuantMode("q4-int8head", "as q4, with the head requantized to int8 per output channel "
              "(lossy beyond the file)", True, "float32", _packed("int8"),
              applies=_q4_applies, available=_int4_kernel),
)}

# Modes ``auto`` may pick for a GGUF, fastest first; each must be batch-invariant (T4) and keep
# the file's values up to rounding, so that the default answers what the model answers (the
# exact fp32 mode, transformers on the same file). Not packed-q8: it is the fastest invariant
# mode (1.3x / 2.2x / 2.3x llama.cpp's decode tok/s at batch 1 / 8 / 32) and computes exactly
# what llama.cpp's CPU path computes (8-bit activations; the same greedy tokens as llama.cpp),
# but on SmolLM2-135M that changes answers: asked "What is the capital of France?" (greedy, chat)
# packed-q8 and llama.cpp both say "L'Étoile, la Marseillaise, ...", fp32 and packed say "The
# capital of France is Paris." It is the measured opt-in (`--quant packed-q8`), as is
# q4-int8head. Matmuls of one SmolLM2-135M decode step, 2-core AVX2 EPYC, 1 thread, ms at
# M = 1 / 8 / 32 rows (`python benchmarks/bench_kernels.py --threads 1 --repeats 3`):
#   fp32 dense 46.6 / 95.5 / 191.2 (not batch-invariant), torch int4 (q4) 36.1 / 72.0 / 433.9,
#   torch int8 37.3 / 66.8 / 325.5, packed 22.5 / 50.8 / 266.1, packed-q8 9.8 / 29.6 / 148.3.
# A float GGUF (every matrix F32/F16/BF16) ends at fp32-kernel, the batch-invariant dense mode.
AUTO_ORDER: tuple[str, ...] = ("packed", "q4", "fp32-kernel")
# An HF folder's ``auto``: the invariant dense mode where the native module runs, else fp32.
# fp32-kernel / F.linear speed (> 1: the kernel is faster), 1 thread each, CPU clock, 2-core
# AVX-512 Xeon shared with other jobs (`python benchmarks/bench_dense.py --threads 1 --clock
# cpu --repeats 5`): default model's step 1.81x at 1 row, 0.85x at 512 rows; a 1B layer 0.81x
# at 1 row (memory-bound gemv), 1.03x at 512 rows (run-to-run noise here ~ +-0.1). Issue 18's goal (>= 0.97x at 1 row, >= 0.8x
# at 512) is met except by the 1B layer at 1 row (0.81x: the gemv streams its rows slower than
# MKL's; more rows in flight per group or software prefetch tuning would close it); the invariance is what the default buys (issue 20 D10), fp32 stays the opt-out.
FOLDER_AUTO = "fp32-kernel"
MODE_NAMES: tuple[str, ...] = ("auto", *QUANT_MODES)


def resolve_mode(quant: str, dtype: str | None, ckpt: GGUFCheckpoint | None) -> QuantMode:
    """The mode to load: ``quant`` (a name or ``"auto"``), ``dtype`` (an explicit dense
    dtype, or None), ``ckpt`` the opened GGUF (None for an HF folder). See the module
    docstring; raises ModelLoadError / UnsupportedModelError with the reason."""
    if quant not in MODE_NAMES:
        raise ModelLoadError(f"unknown --quant {quant!r}; modes: {', '.join(MODE_NAMES)}")
    if dtype is not None and dtype not in DENSE_BY_DTYPE:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {sorted(DENSE_BY_DTYPE)}")
    by_dtype = QUANT_MODES[DENSE_BY_DTYPE[dtype]] if dtype is not None else None
    if quant == "auto":
        if by_dtype is not None:
            return by_dtype  # NOTE: an explicit dtype asks for a dense model
        if ckpt is not None:
            for name in AUTO_ORDER:
                mode = QUANT_MODES[name]
                if mode.available() is None and mode.applies(ckpt) is None:
                    return mode
        elif QUANT_MODES[FOLDER_AUTO].available() is None:
            return QUANT_MODES[FOLDER_AUTO]
        return QUANT_MODES["fp32"]  # NOTE: not batch-invariant; the load summary says so
    mode = QUANT_MODES[quant]
    if dtype is not None and mode.dtype != dtype:
        raise ModelLoadError(f"--dtype {dtype} contradicts --quant {quant} "
                             f"(which runs {mode.dtype} activations); give one of them")
    if ckpt is None and not mode.dense:
        dense = ", ".join(n for n, m in QUANT_MODES.items() if m.dense)
        raise UnsupportedModelError(f"--quant {quant} needs a GGUF file; an HF folder is "
                                    f"served dense: {dense}")
    why = mode.available()
    if why is not None:
        raise UnsupportedModelError(f"--quant {quant} is not available on this machine: {why}")
    if ckpt is not None and (why := mode.applies(ckpt)) is not None:
        raise UnsupportedModelError(f"--quant {quant} does not apply to {ckpt.path.name}: {why}")
    return mode


def modes_for(ckpt: GGUFCheckpoint | None) -> tuple[QuantMode, tuple[str, ...]]:
    """What ``auto`` picks for ``ckpt`` (None: an HF folder) and every mode that would load."""
    names = tuple(n for n, m in QUANT_MODES.items()
                  if (m.dense or ckpt is not None) and m.available() is None
                  and (ckpt is None or m.applies(ckpt) is None))
    return resolve_mode("auto", None, ckpt), names


def load_gguf_model(path: str | Path | GGUFCheckpoint, quant: str = "auto",
                    device: str = "cpu") -> CausalLM:
    """A GGUF file's model in serving mode ``quant`` (for benchmarks, scripts and tests; the
    engine loads through :func:`coda.models.source.open_model`)."""
    ckpt = path if isinstance(path, GGUFCheckpoint) else open_gguf(path)
    return resolve_mode(quant, None, ckpt).build_gguf(ckpt, device)


def folder_identity(model_dir: str | Path, dtype: str,
                    chat_template: str | None = None,
                    quant_mode: str | None = None, rope: str | None = None) -> ModelIdentity:
    """``model_snapshot`` of an HF safetensors folder (P1): its weight files' bytes, its
    ``tokenizer.json``, its chat template (the one the loader resolved; by default the folder's
    own, as :func:`coda.models.tokenizer_bundle.bundle_from_hf_dir` finds it), the serving dtype
    and mode (``quant_mode``; by default the dense mode of ``dtype``: ``fp32``/``bf16``/``fp16``), the
    mode's summation order (``QuantMode.kernel_order``) and the Coda version. Computed once at load by :func:`coda.models.identity.model_identity`."""
    from coda.models.loader import safetensors_files  # NOTE: torch (see the builders' note)

    model_dir = Path(model_dir)
    mode = quant_mode or DENSE_BY_DTYPE.get(dtype)
    kernel_order = QUANT_MODES[mode].kernel_order() if mode in QUANT_MODES else None
    template = chat_template if chat_template is not None else folder_chat_template(model_dir)
    return model_identity(weights_sha256=digest_files(safetensors_files(model_dir)),
                          tokenizer=(model_dir / "tokenizer.json").read_bytes(),
                          chat_template=template, dtype=dtype,
                          quant_mode=mode, kernel_order=kernel_order, rope=rope)
