"""``coda --help`` and each command's ``--help`` (coda/cli.py): ``serve`` names every protocol
it answers (OpenAI with Responses, Anthropic, Ollama), and every help paragraph reads as one
paragraph the terminal wraps, not cut at the docstring's source lines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

from coda import cli
from coda.cli import app

COMMANDS: dict[tuple[str, ...], Callable[..., Any]] = {
    ("serve",): cli.serve, ("generate",): cli.generate, ("bench",): cli.bench,
    ("models",): cli.models, ("trace", "check"): cli.trace_check}


def _help(args: list[str], width: int = 400) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(width),
                                                          "TERMINAL_WIDTH": str(width)})
    assert res.exit_code == 0, res.output
    return res.output


def test_serve_help_names_every_protocol() -> None:
    """The command list and ``serve --help`` say Coda serves OpenAI (Responses too),
    Anthropic and Ollama."""
    for text in (_help([]), _help(["serve"])):
        flat = " ".join(text.split())
        for name in ("OpenAI", "Responses", "Anthropic", "Ollama"):
            assert name in flat, (name, text)


@pytest.mark.parametrize("args", [list(k) for k in COMMANDS], ids=" ".join)
def test_help_paragraphs_are_not_cut_at_source_lines(args: list[str]) -> None:
    """On a wide terminal each paragraph of a command's help is one line of its ``--help``,
    and its first paragraph one line of the command list: no break from the docstring's
    source lines (typer's rich help keeps them)."""
    fn = COMMANDS[tuple(args)]
    paragraphs = [" ".join(p.split()) for p in (fn.__doc__ or "").split("\n\n")]
    lines = _help(args).splitlines()
    for paragraph in paragraphs:
        assert any(paragraph in line for line in lines), (paragraph, lines)
    listed = _help(args[:-1]).splitlines()
    assert any(paragraphs[0] in line for line in listed), (paragraphs[0], listed)


def test_models_help_summary_is_one_line_in_the_command_list() -> None:
    """``coda --help`` lists ``models`` with its one-line summary (the reported odd breaks)."""
    line = next(r for r in _help([]).splitlines() if " models " in r)
    assert "List loadable models and the serving modes each loads in." in line


def test_models_file_help_shows_its_toml_tables() -> None:
    """``--models-file``'s ``[[model]]`` is text, not rich markup (it was eaten to ``[]``)."""
    assert "[[model]] tables" in _help(["serve"])
