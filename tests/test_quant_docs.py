"""The serving modes as the README and ``--quant --help`` state them are the modes that exist,
and ``auto``'s documented choice for an HF folder is the one it makes (the CLI/API acceptance
sweep: both named ``fp32`` for a folder while ``auto`` loads ``fp32-kernel``, and neither
listed ``fp32-kernel``, which ``--quant`` accepts)."""

from __future__ import annotations

import re
from pathlib import Path

from coda import cli
from coda.models.modes import FOLDER_AUTO, QUANT_MODES

ROOT = Path(__file__).resolve().parent.parent


def _quant_help() -> str:
    return str(cli.QuantOpt.__metadata__[0].help)  # type: ignore[attr-defined]


def _readme_quant_paragraph() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("`--quant MODE`")
    return text[start:text.index("\n\n", start)]


def test_every_mode_is_named_in_the_readme_and_the_flag_help() -> None:
    readme, help_text = _readme_quant_paragraph(), _quant_help()
    for name in QUANT_MODES:
        assert f"`{name}`" in readme, name
        assert re.search(rf"(^|[ :,]){re.escape(name)}([ ,(]|$)", help_text), name


def test_auto_for_a_folder_is_the_documented_mode() -> None:
    """Where ``coda._native`` runs (this test's premise: FOLDER_AUTO is available), ``auto``
    serves an HF folder in FOLDER_AUTO, and the help and the README say that one."""
    assert QUANT_MODES[FOLDER_AUTO].available() is None
    assert f"HF folder: {FOLDER_AUTO})" in _quant_help()
    assert re.search(rf"an HF folder[^.;]*runs `{re.escape(FOLDER_AUTO)}`",
                     _readme_quant_paragraph())
