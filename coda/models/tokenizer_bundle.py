"""Everything text-side a model brings: tokenizer, chat template, special tokens, end ids.

One :class:`TokenizerBundle` per loaded model, built from an HF folder
(:func:`bundle_from_hf_dir`) or a GGUF file (:func:`bundle_from_gguf`) — the engine and the
server never look at the files themselves.

HF folders, resolved as ``transformers`` does:

* chat template: ``chat_template.jinja``, else ``chat_template.json`` (``{"chat_template":
  ...}``), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
  templates: ``default`` wins);
* ``bos_token``/``eos_token`` text: ``tokenizer_config.json`` (string or AddedToken dict), else
  ``special_tokens_map.json``, else the token of ``config.json``'s id;
* end ids: ``generation_config.json``'s ``eos_token_id`` (int or list) together with
  ``config.json``'s, the id of the tokenizer's ``eos_token``, and every turn-end token the chat
  template writes (``<end_of_turn>``, ``<|im_end|>`` …, llama.cpp's end-of-generation texts)
  that the vocabulary holds: any of them ends a turn.

A model without a template gets its family's turn format where Coda knows it (a Gemma 3 GGUF
without ``tokenizer.chat_template``: :data:`GEMMA_CHAT_TEMPLATE`), else ChatML, and
:attr:`TokenizerBundle.chat_template_origin` says so (the CLI prints it at load): a missing
template is never silent.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from coda.models.config import ModelConfig, ModelLoadError
from coda.models.gguf_tokenizer import EOG_TEXTS, GGUFVocab, build_tokenizer, end_of_generation_ids

log = logging.getLogger("coda.models")

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_TEMPLATE_ORIGIN = "none in the model: Coda's default ChatML template"
# NOTE: Gemma's turn format for Gemma files that carry no template; written for Coda from the
# format's description. Gemma has no system role: a system message's text opens the next user
# turn (several in a row joined by a blank line); one no user turn follows (a lone system
# message, or one before an assistant turn) is a user turn of its own, so none is dropped.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(pending='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.pending = ns.pending + (message['content'] | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{%- if role == 'model' and ns.pending -%}"
    "{{ '<start_of_turn>user\n' + ns.pending | trim + '<end_of_turn>\n' }}"
    "{%- set ns.pending = '' -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + ns.pending }}"
    "{%- set ns.pending = '' -%}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.pending %}{{ '<start_of_turn>user\n' + ns.pending | trim + '<end_of_turn>\n' }}"
    "{% endif -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)
_FAMILY_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}


@dataclass(frozen=True)
class TokenizerBundle:
    """The tokenizer and its conventions. ``eos_token_ids`` is the end-of-generation set."""

    tokenizer: tokenizers.Tokenizer
    chat_template: str
    chat_template_origin: str  # a file or metadata key, or DEFAULT_TEMPLATE_ORIGIN
    bos_token: str
    eos_token: str
    eos_token_ids: frozenset[int]

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids (completions, Ollama ``raw``, embeddings, ``coda generate``): the
        text with the tokenizer's special tokens (its BOS), the BOS once — a text that already
        opens with the BOS keeps its own and gets no second one (a doubled BOS is a sequence
        start mid-sequence, which Gemma answers far worse; a rendered chat template writing
        ``{{ bos_token }}`` is encoded without special tokens, so it too has one)."""
        tok = self.tokenizer
        ids = list(tok.encode(text, add_special_tokens=True).ids)
        bos = tok.token_to_id(self.bos_token) if self.bos_token else None
        if bos is None or ids[:2] != [bos, bos] or not text.startswith(self.bos_token):
            return ids
        plain = tok.encode(text, add_special_tokens=False).ids
        # NOTE: more leading BOS than the text has: the tokenizer added one; drop it
        return ids[1:] if _leading(ids, bos) > _leading(plain, bos) else ids

    def describe_eos(self) -> str:
        tok = self.tokenizer
        return ", ".join(f"{i} {tok.id_to_token(i)!r}" for i in sorted(self.eos_token_ids))


def _leading(ids: list[int], token: int) -> int:
    """How many times ``ids`` opens with ``token``."""
    n = 0
    while n < len(ids) and ids[n] == token:
        n += 1
    return n


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} cannot be read as JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # NOTE: AddedToken dicts in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # NOTE: multi-template configs: the default one
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def hf_chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> tuple[str, str]:
    """``(template, origin)`` for an HF folder, in transformers' order of precedence."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), jinja.name
    from_json = _pick_template(_read_json(model_dir / "chat_template.json").get("chat_template"))
    if from_json:
        return from_json, "chat_template.json"
    from_cfg = _pick_template(tok_cfg.get("chat_template"))
    if from_cfg:
        return from_cfg, "tokenizer_config.json"
    return DEFAULT_CHAT_TEMPLATE, DEFAULT_TEMPLATE_ORIGIN


def folder_chat_template(model_dir: Path) -> str:
    """The chat template an HF folder resolves to (for its identity, P1)."""
    return hf_chat_template(model_dir, _read_json(model_dir / "tokenizer_config.json"))[0]


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def bundle_from_hf_dir(model_dir: Path, cfg: ModelConfig) -> TokenizerBundle:
    """The bundle of an HF model folder (``tokenizer.json`` required)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no tokenizer.json")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: the tokenizers library raises a bare Exception
        raise ModelLoadError(f"{path} is not a readable tokenizer: {exc}") from None
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    smap = _read_json(model_dir / "special_tokens_map.json")
    gen = _read_json(model_dir / "generation_config.json")
    template, origin = hf_chat_template(model_dir, tok_cfg)

    def special(name: str, fallback_id: int | None) -> str:
        text = _token_text(tok_cfg.get(name)) or _token_text(smap.get(name))
        if text is None and fallback_id is not None:
            text = tok.id_to_token(fallback_id)
        return text or ""

    eos_ids = _ids(gen.get("eos_token_id")) | set(cfg.eos_token_ids)
    first_eos = min(eos_ids) if eos_ids else None
    eos_text = special("eos_token", first_eos)
    eos_tok = tok.token_to_id(eos_text) if eos_text else None
    if eos_tok is not None:
        eos_ids.add(eos_tok)
    eos_ids |= template_turn_ends(tok, template)
    return TokenizerBundle(tok, template, origin, special("bos_token", cfg.bos_token_id),
                           eos_text, frozenset(eos_ids))


def template_turn_ends(tok: tokenizers.Tokenizer, template: str) -> set[int]:
    """Ids of the end-of-generation tokens (llama.cpp's list of turn-end texts) that the chat
    template writes and the vocabulary holds: a chat turn must end where the template ends it
    (Gemma's ``<end_of_turn>``, which its ``config.json`` may not list)."""
    found = (tok.token_to_id(text) for text in EOG_TEXTS if text in template)
    return {i for i in found if i is not None}


def bundle_from_gguf(ckpt: Any) -> TokenizerBundle:
    """The bundle of an opened :class:`~coda.models.gguf_file.GGUFCheckpoint`."""
    vocab = GGUFVocab.from_fields(ckpt.field)
    tok, _ = build_tokenizer(vocab)
    template = ckpt.field("tokenizer.chat_template", None)
    origin = "GGUF tokenizer.chat_template"
    arch = ckpt.field("general.architecture", None)
    if (not isinstance(template, str) or not template) and arch in _FAMILY_TEMPLATES:
        template = _FAMILY_TEMPLATES[arch]
        origin = f"none in the file: Coda's {arch} turn format"
    if not isinstance(template, str) or not template:
        template, origin = DEFAULT_CHAT_TEMPLATE, DEFAULT_TEMPLATE_ORIGIN
    bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else ""
    eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else ""
    return TokenizerBundle(tok, template, origin, bos, eos,
                           end_of_generation_ids(vocab, ckpt.field)
                           | template_turn_ends(tok, template))
