"""Tiny GGUF files written with ``gguf.GGUFWriter`` (issue 9 item 1; SPEC T3): the qwen2, qwen3
and Mistral (llama) layouts against ``transformers``' own GGUF loading, quantized tensors, the
SentencePiece tokenizer with byte fallback, and load failures that name what is missing."""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from coda.cli import app
from coda.models.config import ModelLoadError, UnsupportedModelError
from coda.models.gguf_file import open_gguf
from coda.models.gguf_weights import load_gguf_model
from coda.models.source import resolve_model
from coda.models.tokenizer_bundle import bundle_from_gguf
from tests.test_models import full_forward

H, F, L, NH, NKV, HD = 64, 96, 2, 4, 2, 16
BPE_TOKENS = [chr(c) for c in range(33, 127)] + ["Ġ", "Ġt", "he", "Ġthe", "<|endoftext|>",
                                                    "<|im_start|>", "<|im_end|>"]
PROMPT = [5, 17, 40, 2, 88, 93, 94, 61, 3, 70]


def write_gguf(path: Path, arch: str, *, name: str = "tiny", qtype: str = "F32",
               seed: int = 0, extra_tokens: int = 0, tied_embd_qtype: str | None = None,
               bos: bool = False) -> Path:
    """A random 2-layer model with a small byte-level BPE vocabulary (``extra_tokens`` more
    plain tokens at its end: the int4 kernel needs a vocabulary that is a multiple of 16);
    ``tied_embd_qtype``: no ``output.weight``, the embedding stored in that type."""
    rng = np.random.default_rng(seed)
    # NOTE: transformers' qwen3 GGUF config ignores key_length (head_dim stays 128)
    hid, hd = (NH * 128, 128) if arch == "qwen3" else (H, HD)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(hid)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
    extra = [f"<x{i}>" for i in range(extra_tokens)]
    w.add_token_list(BPE_TOKENS + extra)
    w.add_token_types([1] * (len(BPE_TOKENS) - 3) + [3, 3, 3] + [1] * extra_tokens)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_eos_token_id(len(BPE_TOKENS) - 1)
    if bos:  # NOTE: <|im_start|> stands in for a BOS the tokenizer prepends (Gemma, Llama)
        w.add_bos_token_id(len(BPE_TOKENS) - 2)
        w.add_add_bos_token(True)
    vocab = len(BPE_TOKENS) + extra_tokens

    def t(name: str, *shape: int, qtype: str = qtype) -> None:
        scale = 0.2 * min(1.0, (64 / shape[-1]) ** 0.5)  # NOTE: keeps activations O(1)
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if "norm" in name:
            arr = 1 + arr * 0.1
        kind = qtype if len(shape) == 2 and shape[-1] % 32 == 0 and "norm" not in name else "F32"
        if kind == "F32":
            w.add_tensor(name, arr)
        else:
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)

    t("token_embd.weight", vocab, hid, qtype=tied_embd_qtype or qtype)
    t("output_norm.weight", hid)
    if tied_embd_qtype is None:
        t("output.weight", vocab, hid)
    for i in range(L):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", hid)
        t(p + "ffn_norm.weight", hid)
        t(p + "attn_q.weight", NH * hd, hid)
        t(p + "attn_k.weight", NKV * hd, hid)
        t(p + "attn_v.weight", NKV * hd, hid)
        t(p + "attn_output.weight", hid, NH * hd)
        if arch == "qwen2":
            for n, rows in (("q", NH * hd), ("k", NKV * hd), ("v", NKV * hd)):
                t(p + f"attn_{n}.bias", rows)
        if arch == "qwen3":
            t(p + "attn_q_norm.weight", hd)
            t(p + "attn_k_norm.weight", hd)
        t(p + "ffn_gate.weight", F, hid)
        t(p + "ffn_up.weight", F, hid)
        t(p + "ffn_down.weight", hid, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("arch", "name", "kind"), [("qwen2", "tiny", "qwen2"),
                                                     ("qwen3", "tiny", "qwen3"),
                                                     ("llama", "tiny mistral", "mistral")])
def test_t3_tiny_gguf_logits_equal_transformers(tmp_path: Path, arch: str, name: str,
                                                kind: str) -> None:
    """T3: config from metadata, q/k row order (llama.cpp's permutation for llama/mistral,
    none for qwen), biases and q/k norms: logits equal transformers' GGUF loading."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, name=name)
    ckpt = open_gguf(path)
    assert ckpt.config.arch == kind
    ours = full_forward(load_gguf_model(ckpt), PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_tensors_dequantize_like_transformers(tmp_path: Path, qtype: str) -> None:
    """Each tensor type dequantizes (at load) to what transformers computes from the file."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "q.gguf", "qwen2", qtype=qtype)
    ours = full_forward(load_gguf_model(path), PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    assert open_gguf(path).config.vocab_size == len(BPE_TOKENS)


def spm_gguf(path: Path) -> Path:
    """Metadata only: a llama-style SentencePiece vocabulary with scores and 256 byte tokens."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = ["▁", *string.ascii_lowercase, "▁t", "he", "▁the", "▁c", "at", "▁cat", "ll", "o",
             "llo", "▁he", "▁hello"]
    words = list(dict.fromkeys(words))
    pieces += words
    types += [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_k2_spm_byte_fallback_and_byte_tokens_are_not_special(tmp_path: Path) -> None:
    """SentencePiece from scores: merges by score, a space prefix, unknown characters as
    <0xNN> byte tokens that decode to the exact bytes, and byte tokens are never special
    (skip_special_tokens keeps them), while <s> and </s> are."""
    from gguf import GGUFReader

    reader = GGUFReader(str(spm_gguf(tmp_path / "spm.gguf")))

    class Meta:
        @staticmethod
        def field(key: str, default: object = None) -> object:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

    bundle = bundle_from_gguf(Meta)
    tok = bundle.tokenizer
    enc = tok.encode("the cat", add_special_tokens=True)
    assert enc.tokens == ["<s>", "▁the", "▁cat"]
    text = "hello é😀"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    names = [tok.id_to_token(i) for i in ids]
    assert "<0xC3>" in names and "<0xF0>" in names  # é and the emoji fell back to bytes
    assert bundle.eos_token_ids == frozenset({2}) and bundle.bos_token == "<s>"
    assert tok.decode(tok.encode("<s>the</s>").ids, skip_special_tokens=True) == "the"


def test_unsupported_arch_and_tensor_type_fail_at_load_naming_what(tmp_path: Path) -> None:
    """An unknown architecture or tensor type is a typed error naming it; the CLI prints the
    message and exits 2, never a stack trace."""
    path = write_gguf(tmp_path / "g.gguf", "gemma")
    with pytest.raises(UnsupportedModelError, match="'gemma'"):
        open_gguf(path)
    res = CliRunner().invoke(app, ["generate", "hi", "--model", str(path)])
    assert res.exit_code == 2 and "gemma" in res.output and "Traceback" not in res.output
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("no-such-model-anywhere")


def test_cli_generate_gives_a_raw_prompt_the_models_bos(tmp_path: Path) -> None:
    """``coda generate PROMPT`` encodes a raw prompt as ``/v1/completions`` does: with the
    special tokens the GGUF asks for (``add_bos_token``: Gemma's and Llama's files); without
    its BOS such a model answers garbage (found on Gemma 3 270M)."""
    path = write_gguf(tmp_path / "bos.gguf", "llama", bos=True)
    tok = bundle_from_gguf(open_gguf(path)).tokenizer
    want = len(tok.encode("the", add_special_tokens=True).ids)
    assert want == len(tok.encode("the", add_special_tokens=False).ids) + 1
    res = CliRunner().invoke(app, ["generate", "the", "--model", str(path), "--max-tokens", "1",
                                   "--quant", "fp32"])
    assert res.exit_code == 0, res.output
    assert f'"prompt_tokens": {want},' in res.output
