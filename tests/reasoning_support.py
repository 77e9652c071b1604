"""The default model as a reasoning model (issue 23): its tokenizer with Qwen3's ``<think>`` and
``</think>`` as non-special added tokens (taking the ids of two rare vocabulary entries, so the
model's logits cover them) and a ChatML template whose generation prompt opens the reasoning
(DeepSeek-R1 style, ``inside``) or leaves it to the model (Qwen3 style)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coda.engine.async_engine import DEFAULT_MODEL_DIR
from tests.wire_support import ScriptedServer, scripted_server

OPEN_ID, CLOSE_ID = 4094, 4095
EOS = 2                                  # <|im_end|>
ME, THINK, THERE, DOT = 446, 1660, 963, 16  # " me", " think", " there", "."

# The output " me think" </think> " there." then EOS, keyed on the last token (wire_support);
# the prompt's last token is "\n" (inside) or the model opens with <think> first.
CHAIN = {OPEN_ID: ME, ME: THINK, THINK: CLOSE_ID, CLOSE_ID: THERE, THERE: DOT, DOT: EOS}

_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
             "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|im_start|>assistant\\n' }}{{ GEN }}{% endif %}")


def reasoning_model_dir(root: Path, inside: bool) -> Path:
    """A model folder in ``root``: the default model's weights and config (linked), the
    reasoning tokenizer and template."""
    out = root / ("r1" if inside else "qwen3")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if not (out / name).exists():
            os.symlink(DEFAULT_MODEL_DIR / name, out / name)
    tok = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    inv = {i: s for s, i in vocab.items()}
    gone = {inv[OPEN_ID], inv[CLOSE_ID]}
    for s in gone:
        del vocab[s]
    tok["model"]["merges"] = [m for m in tok["model"]["merges"]
                              if "".join(m if isinstance(m, list) else m.split(" ")) not in gone]
    for i, text in ((OPEN_ID, "<think>"), (CLOSE_ID, "</think>")):
        vocab[text] = i
        tok["added_tokens"].append({"id": i, "content": text, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    gen = "'<think>\\n'" if inside else "''"
    cfg["chat_template"] = _TEMPLATE.replace("GEN", gen)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def reasoning_server(factory: pytest.TempPathFactory, chain: dict[int, int],
                     inside: bool) -> Iterator[ScriptedServer]:
    """A scripted server over the reasoning model (a module fixture's body): ``inside``, the
    template opens the block and the output starts in it; else the model opens it first."""
    root: Path = factory.mktemp("reasoning")
    yield from scripted_server(chain, model_dir=reasoning_model_dir(root, inside=inside),
                               first=chain[OPEN_ID] if inside else OPEN_ID)
