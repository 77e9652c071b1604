"""The workloads of ``benchmarks/bench_speculative.py`` (issue 21), as chat turns a user would
send: ``copy`` (edit a ~350-token Python file: the file in a code fence, one small specific
change, "reply with the whole updated file"; and quote sentences of a ~300-token document word
for word), ``free`` (free-text chat), ``predict`` (the same edits, each file as the chat
``prediction``), and for a base model (no chat, raw text as a completion is sent) ``recite``
(each code file followed by five of its lines again, its first and then from its middle: a base
model continues a document by copying it, where an instruct model follows the copy
instruction) and ``prose`` (the openings of eight prose documents to continue: a base model
answers a chat turn by echoing it, so ``free`` is mostly a copy there). :func:`chat_ids` renders the chats with the
model's own chat template and encodes them as the server does (no special tokens added: the
template has them); ``recite``'s raw texts are encoded as a completion is (BOS added).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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
# NOTE: quote extraction: each answer is sentences of _DOC, verbatim (chosen among six such
# questions: the two that SmolLM2-135M answered in its own words were left out, docs/speculative.md)
_QUOTES = ("Copy every sentence of the document that contains a year, word for word, one per line.",
           "Quote, word for word, the sentences of the document about the first keeper.",
           "Quote the sentence of the document that says how tall the tower is, word for word.",
           "Quote the two sentences of the document that mention the reef, word for word.")
# NOTE: edit a ~350-token file: one small, specific change, the whole file back (spec_files/)
_EDITS = (("inventory.py", "Rename the method `low_stock` to `items_below` (and its call in `main`)."),
          ("temperature.py", 'Change the default unit in `parse_args` from "c" to "f".'),
          ("wordcount.py", 'Add "from" to the set of stop words in `main`.'),
          ("bank.py", 'Change the message of the ValueError in `deposit` to "amount must be positive".'))
_FREE = ("Write a short story about a fox who learns to sail.",
         "Explain why the sky is blue to a ten-year-old.",
         "Describe your ideal weekend in the mountains.",
         "Write a poem about the sea at night.",
         "What are three tips for learning a new language?",
         "Tell me about the history of bread.",
         "Write a letter to a friend who moved abroad.",
         "Describe a busy market in the morning.")

# NOTE: prose for a base model to continue (the free workload's subjects, as documents)
_PROSE = ("The fox had never seen a boat before the morning the fisherman left his dinghy",
          "Sunlight looks white, but it is a mixture of every colour. When it reaches the air,",
          "Our weekend in the mountains began before dawn, with a thermos of coffee and",
          "At night the sea is a different animal. The waves that glitter by day",
          "Learning a new language as an adult is hard, but three habits make it easier.",
          "Bread is one of the oldest prepared foods. The earliest loaves, baked",
          "Dear Anna, it has been three months since you moved to Lisbon, and the street",
          "By six in the morning the market square is already crowded with stalls")


def _code_files() -> list[str]:
    """The edit workload's files: small, ordinary Python programs (~350 tokens each)."""
    return [(ROOT / "benchmarks" / "spec_files" / name).read_text() for name, _ in _EDITS]


def chatml(user: str) -> str:
    """SmolLM2's ChatML turn without its template's default system prompt (the old bench's)."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _edit(code: str, change: str) -> str:
    return (f"```python\n{code}```\n\n{change} Reply with the whole updated file in a Python "
            f"code block, nothing else.")


def predictions(workload: str) -> list[str] | None:
    """The ``predict`` workload's predictions (each prompt's file as it is), else None."""
    return _code_files() if workload == "predict" else None


def recite_prompts(lines: int = 5) -> list[str]:
    """``recite``'s texts: each code file, a blank line, then ``lines`` of its lines again from
    its first line (the first four texts) and from its middle (the last four)."""
    files = _code_files()
    out = []
    for middle in (False, True):
        for code in files:
            rows = code.splitlines(keepends=True)
            start = len(rows) // 2 if middle else 0
            out.append(code + "\n" + "".join(rows[start:start + lines]))
    return out


def messages(workload: str) -> list[str]:
    """The workload's user messages (each one chat turn)."""
    if workload == "free":
        return list(_FREE)
    edits = [_edit(code, change) for code, (_, change) in zip(_code_files(), _EDITS, strict=True)]
    if workload == "predict":
        return edits
    quotes = [f"Document:\n\n{_DOC}\n\n{q}" for q in _QUOTES]
    return [p for pair in zip(edits, quotes, strict=True) for p in pair]


def chat_ids(engine: Any, workload: str) -> list[tuple[int, ...]]:
    """The workload's prompts as the server would run them on ``engine`` (an AsyncEngine):
    rendered by its chat template, encoded without added special tokens."""
    from coda.server.chat import render_chat

    if workload in ("recite", "prose"):
        texts = recite_prompts() if workload == "recite" else list(_PROSE)
        return [tuple(engine.tokenizer.encode(t).ids) for t in texts]
    return [tuple(engine.tokenizer.encode(render_chat(engine, [{"role": "user", "content": m}]),
                                          add_special_tokens=False).ids)
            for m in messages(workload)]


def prompts(workload: str, render: Callable[[str], str] = chatml) -> list[str]:
    """The workload's prompts: each user message rendered by ``render`` (the benches pass the
    model's own chat template, coda.server.chat.render_chat, as the server renders a chat)."""
    return [render(m) for m in messages(workload)]
