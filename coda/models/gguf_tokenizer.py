"""A ``tokenizers`` tokenizer rebuilt from GGUF metadata, as llama.cpp reads it (issue 9).

Two tokenizer models (``tokenizer.ggml.model``):

* ``gpt2`` — byte-level BPE with the file's merges. The pre-tokenizer is the one
  ``tokenizer.ggml.pre`` names, as llama.cpp applies it: its regexes split the text one after
  the other (each keeps what it does not match), then GPT-2's byte alphabet. ``llama-bpe``
  style vocabularies also take a whole word that is in the vocabulary without merging
  (llama.cpp's ``ignore_merges``). Decoding is byte-level, with no space clean-up.
  (``transformers``' GGUF converter ignores ``tokenizer.ggml.pre``; it is not used here.)
* ``llama`` — SentencePiece: llama.cpp's merging by score (:mod:`coda.models.gguf_spm`: through
  characters that are not pieces, ties by position), byte fallback to the ``<0xNN>`` tokens,
  spaces as ``▁`` with a space prefix (``add_space_prefix``, default on) before the first text
  and after every special token, as llama.cpp does. Its serialized form (``to_str``) is the
  vocabulary as a whole-piece BPE lookup without merges: the same vocabulary and decoding.

Control and user-defined tokens are added tokens (control ones special); byte tokens
(``<0xNN>``, type 6) are ordinary vocabulary, never special. An unknown ``tokenizer.ggml.pre``
or tokenizer model fails with :class:`UnsupportedModelError` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from coda.models.config import UnsupportedModelError
from coda.models.gguf_spm import exact_spm

# llama.cpp's token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's pre-tokenizer for a family of ``tokenizer.ggml.pre`` names."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool | None = None  # None: the tokenizer model's default


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_GPT2_PRE = PreTokenizer((_GPT2,))
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_DEFAULT_PRE = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _DIGITS_GPT2),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4",
                     "jina-es", "jina-de", "gigachat", "a.x-4.0", "mellum"), _GPT2_PRE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), _QWEN2_PRE),
    "default": _DEFAULT_PRE,
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer arrays and flags of a GGUF file."""

    model: str
    pre: str | None
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] | None
    merges: Sequence[str] | None
    add_bos: bool | None
    add_eos: bool | None
    add_space_prefix: bool | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None

    @cached_property
    def index(self) -> dict[str, int]:
        """Token text -> id (the last id of a text the vocabulary repeats), built once for the
        BPE model and the end-of-generation lookup."""
        return {t: i for i, t in enumerate(self.tokens)}

    @classmethod
    def from_fields(cls, get: Any) -> GGUFVocab:
        """``get(key, default)`` reads one metadata value (arrays as lists)."""
        tokens = get("tokenizer.ggml.tokens", None)
        if not tokens:
            raise UnsupportedModelError("GGUF file has no tokenizer (tokenizer.ggml.tokens)")
        types = get("tokenizer.ggml.token_type", None) or [NORMAL] * len(tokens)

        def opt_int(key: str) -> int | None:
            v = get(key, None)
            return None if v is None else int(v)

        def opt_bool(key: str) -> bool | None:
            v = get(key, None)
            return None if v is None else bool(v)

        return cls(model=str(get("tokenizer.ggml.model", "")), pre=get("tokenizer.ggml.pre", None),
                   tokens=tokens, token_types=[int(t) for t in types],
                   scores=get("tokenizer.ggml.scores", None),
                   merges=get("tokenizer.ggml.merges", None),
                   add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
                   add_eos=opt_bool("tokenizer.ggml.add_eos_token"),
                   add_space_prefix=opt_bool("tokenizer.ggml.add_space_prefix"),
                   bos_id=opt_int("tokenizer.ggml.bos_token_id"),
                   eos_id=opt_int("tokenizer.ggml.eos_token_id"),
                   unk_id=opt_int("tokenizer.ggml.unknown_token_id"))


def build_tokenizer(v: GGUFVocab) -> tuple[Tokenizer, bool]:
    """The tokenizer for ``v`` and whether encode(add_special_tokens=True) prepends BOS."""
    if v.model == "gpt2":
        tok, add_bos = _bpe(v)
        _finish(tok, v, add_bos)
        return tok, add_bos
    if v.model == "llama":
        if v.scores is None:
            raise UnsupportedModelError("GGUF SentencePiece tokenizer has no scores")
        add_bos = v.add_bos if v.add_bos is not None else True
        # NOTE: llama.cpp's merging is no BPE (gguf_spm): the serialized table is the
        # whole-piece lookup, no merges. Ranking every split of every piece into a merge table
        # (what a HF converter writes) took 9 s of a 262k vocabulary's load and encoded nothing:
        # the encoder is gguf_spm's segmentation over a second copy of the same lookup
        # NOTE: one vocabulary model and one added-token list serve both (a 262k vocabulary's
        # model takes ~0.7 s to build, its added tokens ~0.3 s)
        model, added = _spm_model(v), _added_tokens(v)
        plain, lookup = (_finish(_spm_pipeline(Tokenizer(model), v), v, add_bos, added)
                         for _ in range(2))
        return exact_spm(plain, _spm_scores(v), lookup), add_bos
    raise UnsupportedModelError(
        f"GGUF tokenizer model {v.model!r} is not supported; supported: gpt2 (BPE), llama (SPM)")


def _finish(tok: Tokenizer, v: GGUFVocab, add_bos: bool,
            added: list[AddedToken] | None = None) -> Tokenizer:
    """``tok`` with the file's added tokens (``added``, else built) and, where the file asks,
    its BOS template."""
    tok.add_tokens(_added_tokens(v) if added is None else added)  # NOTE: ids already in vocab
    if add_bos and v.bos_id is not None:
        bos = v.tokens[v.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, v.bos_id)])
    return tok


def _pre_tokenizer(v: GGUFVocab) -> PreTokenizer:
    if not v.pre:
        return _DEFAULT_PRE  # NOTE: llama.cpp's fallback (it warns that quality degrades)
    if v.pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {v.pre!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[v.pre]


def _bpe(v: GGUFVocab) -> tuple[Tokenizer, bool]:
    if not v.merges:
        raise UnsupportedModelError("GGUF BPE tokenizer has no merges (tokenizer.ggml.merges)")
    pre = _pre_tokenizer(v)
    # NOTE: as llama.cpp: split at the first space after the first character
    merges = [(m[:cut], m[cut + 1:]) if (cut := m.find(" ", 1)) > 0 else (m, "")
              for m in v.merges]
    vocab = v.index
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    add_bos = v.add_bos if v.add_bos is not None else bool(pre.add_bos)
    return tok, add_bos


def _spm_model(v: GGUFVocab) -> models.BPE:
    """The vocabulary as a whole-piece lookup with byte fallback (no merges)."""
    unk = v.tokens[v.unk_id] if v.unk_id is not None else None
    return models.BPE(v.index, [], unk_token=unk, fuse_unk=True, byte_fallback=True,
                      ignore_merges=True)


def _spm_pipeline(tok: Tokenizer, v: GGUFVocab) -> Tokenizer:
    """``tok`` with SentencePiece's spaces: the normalizer and the decoder."""
    prefix = v.add_space_prefix if v.add_space_prefix is not None else True
    # NOTE: a normalizer, not Metaspace: it runs on every text segment between added tokens and
    # prepends even when the text already starts with a space ("  a" -> "▁▁▁a"), as llama.cpp.
    spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _spm_scores(v: GGUFVocab) -> dict[str, float]:
    """Every token text -> its score (the last id of a repeated text, as llama.cpp's lookup);
    llama.cpp merges into tokens of any type."""
    assert v.scores is not None
    return {t: float(v.scores[i]) for t, i in v.index.items()}


def _added_tokens(v: GGUFVocab) -> list[AddedToken]:
    """Control/unknown tokens become special added tokens, user-defined ones plain added
    tokens (always matched whole, as llama.cpp does); byte tokens are never added."""
    added: list[AddedToken] = []
    for text, kind in zip(v.tokens, v.token_types, strict=True):
        if kind in (CONTROL, UNKNOWN):
            added.append(AddedToken(text, special=True, normalized=False))
        elif kind == USER_DEFINED:
            added.append(AddedToken(text, special=False, normalized=False))
    return added


# Token texts llama.cpp treats as end of generation (llama-vocab.cpp, "special_eog_ids").
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                        "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
                        "<|end_of_text|>", "<end_of_utterance>", "</s>"})
_FIM_PAD = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
_FIM_REP = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP = ("<|file_sep|>",)


def end_of_generation_ids(v: GGUFVocab, get: Any) -> frozenset[int]:
    """llama.cpp's end-of-generation set: EOS, EOT and EOM ids from the metadata, the FIM
    pad/repo/separator tokens, and every token whose text is in its list of turn ends."""
    ids: set[int] = set()
    for key in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
        val = get(f"tokenizer.ggml.{key}_token_id", None)
        if val is not None:
            ids.add(int(val))
    index = v.index
    for key, names in (("fim_pad", _FIM_PAD), ("fim_rep", _FIM_REP), ("fim_sep", _FIM_SEP)):
        if get(f"tokenizer.ggml.{key}_token_id", None) is None:
            found = [index[n] for n in names if n in index]
            if found:
                ids.add(found[0])
    ids.update(index[t] for t in EOG_TEXTS if t in index)
    if v.eos_id is not None:
        ids.add(v.eos_id)
    return frozenset(ids)
