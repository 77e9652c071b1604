"""The spec in the repository (issue 22 step 5): ``docs/spec.md`` defines every rule ID that
``coda/``, ``tests/``, ``docs/``, ``benchmarks/``, ``scripts/`` and the README cite, and each
rule it defines is cited by at least one test, in the test's name or docstring (the convention
of docs/spec.md, so that ``grep -ri l3 tests/`` finds L3's tests).

A citation is one of the spec's section letters and a number (``P3``), or a range
(``S1–S4``). Not citations: an issue's own labels written after the issue (``issue 20 D9``,
``test_issue20_d9_…``: issue 20's defects D1–D10 are not the rules D1–D6), code spans (byte
sequences such as ``E4 B8``), and lint codes after ``noqa``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec.md"
# NOTE: C++ sources are not scanned: their cache levels (L1, L2) and template names (D8) are
# not citations, and their few rule mentions (T4) repeat their Python wrappers'
SCANNED = (ROOT / "coda", ROOT / "tests", ROOT / "docs", ROOT / "benchmarks", ROOT / "scripts",
           ROOT / "README.md")

# NOTE: rules no test names yet, each with the reason; keep it short, prefer a real test (today
# every rule has one)
UNTESTED: dict[str, str] = {}

_DEFINITION = re.compile(r"^- ([A-Z])(\d+) ", re.MULTILINE)
_SECTION = re.compile(r"^## ([A-Z]) — ", re.MULTILINE)
_NOQA = re.compile(r"noqa:?[ A-Z0-9,]*")
# an issue's own labels, one letter: "issue 20 D9", "Issue 20 D6, D9", "issue 20's D10" (in
# "issue 20 D5, P3" P3 is a rule)
_ISSUE_LABELS = re.compile(
    r"\b[Ii]ssue\s+\d+(?:'s)?\s+([A-Z])\d+(?:(?:,?\s+and\s+|,\s+|\s*/\s*)\1\d+)*\b")
_CODE_SPAN = re.compile(r"``.*?``|`[^`\n]*`")


def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def defined_ids(text: str) -> set[str]:
    return {f"{letter}{num}" for letter, num in _DEFINITION.findall(text)}


def section_letters(text: str) -> str:
    return "".join(sorted(set(_SECTION.findall(text))))


def citation_pattern(letters: str) -> re.Pattern[str]:
    # NOTE: the range's second end may repeat the letter (S1–S4) or not (S1–4)
    return re.compile(rf"\b([{letters}])(\d+)(?:\s?[–-]\s?\1?(\d+))?\b")


def cited_in_prose(text: str, letters: str) -> set[str]:
    """IDs cited in free text (docstring, comment, Markdown), ranges expanded."""
    text = _CODE_SPAN.sub(" ", text)
    text = _NOQA.sub(" ", text)
    text = _ISSUE_LABELS.sub(" ", text)
    out: set[str] = set()
    for letter, first, last in citation_pattern(letters).findall(text):
        lo, hi = int(first), int(last or first)
        out.update(f"{letter}{n}" for n in range(lo, max(lo, hi) + 1))
    return out


def cited_in_name(name: str, letters: str) -> set[str]:
    """IDs named by a test function: ``test_k3_l4_…`` cites K3 and L4; the token after an
    ``issueN`` token is that issue's label, not a rule."""
    tokens = name.split("_")
    out: set[str] = set()
    for i, tok in enumerate(tokens):
        if i and re.fullmatch(r"issue\d+", tokens[i - 1]):
            continue
        m = re.fullmatch(rf"([{letters.lower()}])(\d+)", tok)
        if m:
            out.add(m[1].upper() + m[2])
    return out


def scanned_files() -> Iterator[Path]:
    for root in SCANNED:
        files: Iterable[Path] = [root] if root.is_file() else root.rglob("*")
        for path in files:
            # NOTE: this file's own examples cite made-up rules on purpose
            skip = path in (SPEC, Path(__file__).resolve()) or "__pycache__" in path.parts
            if path.suffix in (".py", ".md") and not skip:
                yield path


def defs_of_tests(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
            yield node


def ids_cited_by_tests(letters: str) -> dict[str, list[str]]:
    by_id: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for fn in defs_of_tests(ast.parse(path.read_text(encoding="utf-8"))):
            ids = cited_in_name(fn.name, letters) | cited_in_prose(ast.get_docstring(fn) or "", letters)
            for rule in ids:
                by_id.setdefault(rule, []).append(f"{path.name}::{fn.name}")
    return by_id


# ---------------------------------------------------------------------------------- the checks

def test_spec_defines_its_sections_rules_once() -> None:
    """docs/spec.md: each ID is defined by exactly one rule line, under its own letter's
    section, and the sections are the ones the project cites (L T G K S P C O E D)."""
    text = spec_text()
    lines = _DEFINITION.findall(text)
    assert len(lines) == len(set(lines)), "an ID is defined twice"
    assert section_letters(text) == "CDEGKLOPST"
    assert {"L1", "L7", "T4", "G3", "K3", "S4", "P6", "C4", "O2", "E1", "D6"} <= defined_ids(text)


def test_every_cited_id_is_defined_in_docs_spec() -> None:
    """Every rule ID cited in coda/, tests/, docs/, benchmarks/, scripts/ or the README (prose
    and test names) is defined in docs/spec.md: a citation of a rule that does not exist fails here."""
    text = spec_text()
    letters, defined = section_letters(text), defined_ids(text)
    undefined: dict[str, set[str]] = {}
    for path in scanned_files():
        source = path.read_text(encoding="utf-8")
        ids = cited_in_prose(source, letters)
        if path.suffix == ".py" and path.name.startswith("test_"):
            for fn in defs_of_tests(ast.parse(source)):
                ids |= cited_in_name(fn.name, letters)
        for rule in ids - defined:
            undefined.setdefault(rule, set()).add(str(path.relative_to(ROOT)))
    assert not undefined, f"cited but not defined in docs/spec.md: {undefined}"


def test_every_defined_id_is_cited_by_a_test() -> None:
    """Each rule of docs/spec.md is named by at least one test function (name or docstring),
    except the few listed in UNTESTED with their reason; a listed rule that gains a test
    must leave the list."""
    text = spec_text()
    by_id = ids_cited_by_tests(section_letters(text))
    missing = sorted(defined_ids(text) - set(by_id) - set(UNTESTED))
    assert not missing, f"rules no test names: {missing}"
    stale = sorted(set(UNTESTED) & set(by_id))
    assert not stale, f"UNTESTED lists rules that now have tests: {stale}"
    assert set(UNTESTED) <= defined_ids(text)


def issue_labels_in(text: str) -> set[str]:
    """The labels an issue names in ``text``, lower case: "issue 20 D6, D9" -> {d6, d9}."""
    return {label.lower() for m in _ISSUE_LABELS.finditer(text)
            for label in re.findall(r"[A-Z]\d+", m[0])}


def misnamed(name: str, doc: str, letters: str) -> set[str]:
    """Labels the docstring gives as an issue's but the name cites as rules (``test_d6_…``
    documented "Issue 20 D6": it reads as the rule D6)."""
    return {rule for rule in cited_in_name(name, letters) if rule.lower() in issue_labels_in(doc)}


def test_a_test_named_after_an_issue_label_says_whose_label_it_is() -> None:
    """A test whose docstring cites an issue's label (``Issue 20 D6``) and whose name carries
    the same label must qualify it (``test_issue20_d6_…``): else ``grep -ri d6 tests/`` and
    the check above count it as a test of the rule D6 (issue 20's D1–D6 are not D1–D6)."""
    letters = section_letters(spec_text())
    bad = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for fn in defs_of_tests(ast.parse(path.read_text(encoding="utf-8"))):
            if misnamed(fn.name, ast.get_docstring(fn) or "", letters):
                bad.append(f"{path.name}::{fn.name}")
    assert not bad, f"name an issue's label after its issue (test_issue20_d6_…): {bad}"


# ----------------------------------------------------------------- the parser, on fixed inputs

def test_citations_expand_ranges_and_skip_issue_labels_code_and_lint_codes() -> None:
    letters = "CDEGKLOPST"
    prose = ("SPEC S1–S4, K1-K3, P2; issue 20 D6, D9 and the rest; SPEC D2 (L4); Issue 20 D7, G2 "
             "(K3); issue 20's\n    D10 and `E4 B8` and ``T9``; import x  # noqa: E402")
    assert cited_in_prose(prose, letters) == {"S1", "S2", "S3", "S4", "K1", "K2", "K3", "P2",
                                               "D2", "L4", "G2"}
    assert cited_in_name("test_issue20_d9_l6_message_start", letters) == {"L6"}
    assert cited_in_name("test_d2_g3_deadline_beats_q4_mode", letters) == {"D2", "G3"}


def test_an_undefined_citation_is_found() -> None:
    """The check can fail: a made-up rule in prose or in a test name is cited but undefined."""
    letters, defined = "CDEGKLOPST", defined_ids(spec_text())
    assert cited_in_prose("covers SPEC K9 and L4", letters) - defined == {"K9"}
    assert cited_in_name("test_t17_something", letters) - defined == {"T17"}
    doc = "Issue 20 D6 (S1, S3): min_tokens holds stops."
    assert misnamed("test_d6_s3_min_tokens", doc, letters) == {"D6"}
    assert misnamed("test_issue20_d6_s3_min_tokens", doc, letters) == set()
    assert misnamed("test_d6_early_stop_cancels", "D6: the policy's stop cancels.", letters) == set()
