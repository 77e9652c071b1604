"""Train Coda's embedded default model: a byte-level BPE tokenizer and a tiny Llama.

Output is a Hugging Face-format folder (``coda/assets/default_model/`` by default). CI never
runs this: the weights are shipped. Reproduce with::

    python scripts/train_default_model.py --cache /tmp/dm --minutes 18

(``default_model_corpus.py`` downloads its Debian packages with ``apt-get download`` and its
PyPI packages with ``pip install --target``; nothing else leaves the machine.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: spinning threads crawl on a shared CPU
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_corpus import EOT, build  # noqa: E402

SPECIALS = [EOT, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """Model hyper-parameters (Llama architecture, GQA, tied embeddings)."""

    vocab: int = 4096
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 704
    max_pos: int = 2048


def train_tokenizer(docs: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # NOTE: all 256 bytes, not special
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def llama_config(shape: Shape, tok: Tokenizer) -> object:
    from transformers import LlamaConfig

    eos = [tok.token_to_id(EOT), tok.token_to_id("<|im_end|>")]
    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=shape.max_pos,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(EOT), eos_token_id=eos, pad_token_id=tok.token_to_id(EOT),
        torch_dtype="float32",
    )


def token_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)  # NOTE: documents are packed, separated by <|endoftext|>
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, seq: int, bsz: int, rng: random.Random):  # type: ignore[no-untyped-def]
    n = stream.numel() - seq - 1
    while True:
        starts = torch.tensor([rng.randrange(n) for _ in range(bsz)])
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        yield stream[idx]


def train(args: argparse.Namespace) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    docs = build(Path(args.cache))
    shape = Shape(vocab=args.vocab, layers=args.layers)
    tok = train_tokenizer(docs, shape.vocab)
    stream = token_stream(tok, docs)
    print(f"corpus: {len(docs)} docs, {stream.numel()} tokens, prep {time.time() - t0:.0f}s",
          flush=True)
    model = LlamaForCausalLM(llama_config(shape, tok))  # type: ignore[arg-type]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(0)
    gen = batches(stream, args.seq, args.batch, rng)
    budget, start, step, ema = args.minutes * 60.0, time.time(), 0, None
    total = args.max_steps
    while step < total:
        elapsed = time.time() - start
        if elapsed > budget:
            break
        # NOTE: the cosine runs over wall-clock time: the CPU is shared, step speed varies
        frac = min(1.0, max(elapsed / budget, step / total))
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        # NOTE: HF shifts labels internally, so labels == inputs (the extra token is unused)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f} ema {ema:.3f} lr {lr:.2e} "
                  f"t {time.time() - start:.0f}s", flush=True)
    train_s = time.time() - start
    save(Path(args.out), model, tok, shape)
    meta = {"params": n_params, "steps": step, "final_loss_ema": ema, "train_seconds": train_s,
            "tokens_seen": step * args.batch * args.seq, "corpus_tokens": stream.numel()}
    (Path(args.cache) / "train_meta.json").write_text(json.dumps(meta, indent=2))
    print("done", json.dumps(meta), flush=True)


def save(out: Path, model: torch.nn.Module, tok: Tokenizer, shape: Shape) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    conf = json.loads((out / "config.json").read_text())
    conf.setdefault("torch_dtype", "float32")  # NOTE: older readers look for torch_dtype
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    eos_ids = [tok.token_to_id(EOT), tok.token_to_id("<|im_end|>")]
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False, "special": True}
             for t in SPECIALS}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": "<|im_end|>",
           "pad_token": EOT, "unk_token": None, "model_max_length": shape.max_pos,
           "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    gen = {"bos_token_id": eos_ids[0], "eos_token_id": eos_ids, "pad_token_id": eos_ids[0],
           "do_sample": True, "temperature": 0.8, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", default="/tmp/dm")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1]
                                         / "coda/assets/default_model"))
    ap.add_argument("--minutes", type=float, default=18.0)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bf16", action="store_true")
    train(ap.parse_args())


if __name__ == "__main__":
    main()
