"""The workloads of ``benchmarks/bench_speculative.py`` (issue 21): ``copy`` (edit a ~300-token
code file, quote a ~300-token document), ``free`` (free-text chat) and ``predict`` (repeat a
code file with one change, the file as the chat prediction), as SmolLM2 chat prompts.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DOC = (
    "The lighthouse at Carrow Point was built in 1871 after the wreck of the Margaret Ellis, "
    "a coal schooner that struck the reef in a January gale with the loss of eleven crew. "
    "Its tower is thirty-two metres tall and made of local granite, quarried two miles inland "
    "and carried to the headland on a narrow railway laid for the purpose. The first keeper, "
    "Thomas Reid, kept a log of every ship that passed; his entries describe fog that lasted "
    "nine days in 1874 and a winter so cold that the oil in the lamp thickened. The light was "
    "converted to electricity in 1936 and automated in 1987, when the last keepers left. "
    "Today the keeper's cottage is a small museum, open from April to October, and the "
    "original Fresnel lens, which weighs almost three tonnes, is displayed in its entrance "
    "hall. Visitors can climb the one hundred and forty steps to the gallery on weekends, "
    "weather permitting, and on a clear day the coast of the neighbouring island is visible "
    "thirty kilometres to the north. The reef itself is now a protected area for seabirds, "
    "and landing on it is forbidden between March and August.")
_QUESTIONS = ("When was the light automated?", "How tall is the tower?",
              "What did the first keeper record?", "When can visitors climb the tower?")
_FREE = ("Write a short story about a fox who learns to sail.",
         "Explain why the sky is blue to a ten-year-old.",
         "Describe your ideal weekend in the mountains.",
         "Write a poem about the sea at night.",
         "What are three tips for learning a new language?",
         "Tell me about the history of bread.",
         "Write a letter to a friend who moved abroad.",
         "Describe a busy market in the morning.")


def _code_files() -> list[str]:
    """~300-token slices of Coda's own sources (real code to edit)."""
    out = []
    for name in ("coda/engine/sequence.py", "coda/engine/rng.py", "coda/wakeup.py",
                 "coda/finish.py"):
        text = (ROOT / name).read_text()
        body = text[text.index('"""', 3) + 3:] if text.startswith('"""') else text
        out.append(body.strip()[:1100])
    return out


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _one_change(code: str) -> str:
    """Repeat ``code`` renaming its first function (or ``self``): one change."""
    old = re.findall(r"def (\w+)", code)[0] if "def " in code else "self"
    return (f"Repeat the following code with one change: rename `{old}` to `{old}_v2`.\n\n"
            f"```python\n{code}\n```")


def predictions(workload: str) -> list[str] | None:
    """The ``predict`` workload's predictions (each prompt's code file), else None."""
    return _code_files() if workload == "predict" else None


def prompts(workload: str) -> list[str]:
    if workload == "free":
        return [_chat(p) for p in _FREE]
    if workload == "predict":
        return [_chat(_one_change(code)) for code in _code_files()]
    edits = [_chat("Rename `self` to `this` everywhere in the following code and give the "
                   "whole file back, nothing else:\n\n" + code) for code in _code_files()]
    quotes = [_chat(f"Document:\n{_DOC}\n\nAnswer by quoting the document word for word: {q}")
              for q in _QUESTIONS]
    return [p for pair in zip(edits, quotes, strict=True) for p in pair]
