"""A served model's time (P1 model cards; Ollama ``/api/tags``): ``/v1/models``' ``created``,
Anthropic's ``created_at`` and Ollama's ``modified_at`` are the checkpoint's last change (its
file's time, a folder's newest file's), not the Unix epoch: ``ollama list`` showed every model
as modified 56 years ago."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import anthropic
import ollama
import openai

from tests.conftest import LiveServer


def _newest(folder: Path) -> int:
    return int(max(p.stat().st_mtime for p in folder.iterdir() if p.is_file()))


def test_cards_carry_the_checkpoints_time_p1(server_live: LiveServer,
                                             server_checkpoint: Path) -> None:
    """One model (an HF folder): the same time through the three official clients."""
    want = _newest(server_checkpoint)
    assert want > 0
    card = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k").models.list().data[0]
    assert card.created == want
    listed = anthropic.Anthropic(base_url=server_live.url, api_key="k").models.list().data[0]
    assert listed.created_at == datetime.fromtimestamp(want, UTC)
    tags = ollama.Client(host=server_live.url).list().models
    assert [m.modified_at for m in tags] == [datetime.fromtimestamp(want, UTC)]
    shown = ollama.Client(host=server_live.url).show(tags[0].model or "")
    assert shown.modified_at == datetime.fromtimestamp(want, UTC)
