"""The GGUF vocabulary's one text -> id index (issue 19 item 2: built once per load, for the
BPE model and llama.cpp's end-of-generation set) against brute-force oracles."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.gguf_tokenizer import EOG_TEXTS, GGUFVocab, end_of_generation_ids
from tests.conftest import examples

_TEXTS = sorted(EOG_TEXTS) + ["<|fim_pad|>", "<PAD>", "<reponame>", "<|file_sep|>", "a", "b",
                              "ab", "Ġthe"]


def _vocab(tokens: list[str], eos: int | None) -> GGUFVocab:
    return GGUFVocab(model="gpt2", pre=None, tokens=tokens, token_types=[1] * len(tokens),
                     scores=None, merges=None, add_bos=None, add_eos=None,
                     add_space_prefix=None, bos_id=None, eos_id=eos, unk_id=None)


def _eog_oracle(tokens: list[str], meta: dict[str, Any], eos: int | None) -> frozenset[int]:
    """llama.cpp's set as the loader computed it before the shared index: metadata ids, the
    first FIM name present (by its last id) where the metadata has none, every id whose text
    is a turn end (the last of a repeated text), EOS."""
    last = {t: i for i, t in enumerate(tokens)}
    ids = {int(v) for k, v in meta.items() if v is not None}
    for key, names in (("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")),
                       ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                    "<reponame>")),
                       ("fim_sep", ("<|file_sep|>",))):
        if meta.get(f"tokenizer.ggml.{key}_token_id") is None:
            found = [last[n] for n in names if n in last]
            if found:
                ids.add(found[0])
    ids.update(i for i, t in enumerate(tokens) if t in EOG_TEXTS and last[t] == i)
    if eos is not None:
        ids.add(eos)
    return frozenset(ids)


@given(tokens=st.lists(st.sampled_from(_TEXTS), min_size=1, max_size=30), data=st.data())
@settings(deadline=None, max_examples=examples(100))
def test_vocab_index_and_end_of_generation_ids_equal_their_oracles(tokens: list[str],
                                                                   data: st.DataObject) -> None:
    """For all vocabularies (texts repeated, turn ends and FIM names anywhere) and metadata:
    the index maps each text to its last id, and end_of_generation_ids is the oracle's set."""
    n = len(tokens)
    keys = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
    meta = {f"tokenizer.ggml.{k}_token_id": data.draw(st.none() | st.integers(0, n - 1), label=k)
            for k in keys}
    eos = data.draw(st.none() | st.integers(0, n - 1), label="eos_id")
    v = _vocab(tokens, eos)
    assert v.index == {t: max(i for i, u in enumerate(tokens) if u == t) for t in set(tokens)}
    assert v.index is v.index  # NOTE: built once
    assert end_of_generation_ids(v, lambda key, default: meta.get(key, default)) == \
        _eog_oracle(tokens, meta, eos)
