"""Tiny family fixtures (issue 19 item 1): an HF folder's weights written as llama.cpp's
converter lays them out in a GGUF, so that the folder's transformers logits are the oracle of
the file's.

:func:`folder_to_gguf` writes the folder's config as ``<arch>.*`` metadata, its byte-level BPE
``tokenizer.json`` as a ``gpt2`` vocabulary (pre-tokenizer ``gpt-2``: the folder's own regex),
its chat template as ``tokenizer.chat_template``, and every tensor under its GGUF name: Llama's
q/k rows permuted for llama.cpp's interleaved RoPE, Phi-3's fused ``attn_qkv``/``ffn_up`` as
stored. RoPE scaling metadata and factor tensors are the caller's (``kv``, ``tensors``): each
test states what its file says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.torch import load_file

from coda.models.config import ModelConfig
from coda.models.tokenizer_bundle import folder_chat_template

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{i}.{_LAYER[module]}.{kind}"


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: within a head, HF row ``j * d/2 + i`` is file
    row ``2i + j`` (its RoPE rotates adjacent pairs)."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _vocab(folder: Path) -> tuple[list[str], list[int], list[str]]:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    for t in data.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if t in special else 1 for t in tokens]
    return tokens, types, merges


def add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig, arch: str) -> None:
    """The ``<arch>.*`` hyperparameters of ``cfg``, as llama.cpp's converter writes them."""
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)


def folder_to_gguf(folder: Path, path: Path, arch: str, *,
                   kv: Callable[[gguf.GGUFWriter], None] | None = None,
                   tensors: dict[str, np.ndarray] | None = None) -> Path:
    """``folder`` as a GGUF of ``arch`` at ``path`` (see the module docstring)."""
    cfg = ModelConfig.from_dir(folder)
    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, cfg, arch)
    w.add_rope_dimension_count(cfg.rope_dim)
    if kv is not None:
        kv(w)
    tokens, types, merges = _vocab(folder)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(folder_chat_template(folder))
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    for name, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        arr = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = permute_qk(arr, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy_steps(runner: Any, prompt: list[int], steps: int) -> tuple[list[int], Any]:
    """Prefill ``prompt`` through a :class:`~coda.engine.runner.ModelRunner`, then decode
    ``steps`` greedy tokens one per step: ``(the tokens, each step's logits stacked)``."""
    import torch

    from coda.engine.runner import SeqChunk

    table = tuple(range(runner.num_blocks))
    ids, rows = list(prompt), []
    for _ in range(steps):
        chunk = (SeqChunk(tuple(ids), 0, table, True) if len(ids) == len(prompt)
                 else SeqChunk((ids[-1],), len(ids) - 1, table, True))
        logits = runner.execute([chunk])[0]
        rows.append(logits)
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(rows)


def chat_through_both_sdks(model: Path, messages: list[Any], max_tokens: int = 12,
                           ) -> tuple[str, Any, Any]:
    """Serve ``model`` over loopback and chat with the official ``openai`` and ``anthropic``
    clients (greedy, non-streamed and streamed with openai): ``(the rendered prompt, the
    openai reply, the anthropic reply)``; the streamed text must equal the non-streamed one."""
    import anthropic
    import openai

    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from coda.server.chat import render_chat
    from coda.server.state import ServerSettings
    from tests.conftest import LiveServer

    engine = AsyncEngine.from_model_dir(model, EngineConfig(num_blocks=16,
                                                            default_max_tokens=max_tokens))
    engine.start()
    live = LiveServer(create_app(engine, settings=ServerSettings(keepalive_s=0.5),
                                 manage_engine=False)).start()
    try:
        prompt = render_chat(engine, messages)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=engine.model_name, messages=messages,
                                               max_tokens=max_tokens, extra_body={"temperature": 0})
        streamed = client.chat.completions.create(model=engine.model_name, messages=messages,
                                                  max_tokens=max_tokens, temperature=0,
                                                  stream=True)
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        assert "".join(pieces) == reply.choices[0].message.content
        claude = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
        message = claude.messages.create(model=engine.model_name, messages=messages,
                                         max_tokens=max_tokens, extra_body={"temperature": 0})
        return prompt, reply, message
    finally:
        live.stop()
        engine.shutdown()
