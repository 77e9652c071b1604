"""A long prompt on a SentencePiece GGUF (Gemma 3, Llama 2, Mistral, Phi-3) is tokenized in
O(n log n), not O(n^2) (SPEC K1: the exact segmentation; "bad input is a 4xx, never a hang").

The exact SPM encode cuts the text into llama.cpp's segments with ``NormalizedString``
slices, and one slice costs the length of the string it is taken from. Slicing every segment
out of the whole text was quadratic: found by the acceptance run (accept37) on Gemma 3 270M,
where a 400,000-character chat message took 71 s before its 400 (context exceeded), and a
2 MB body (under the 16 MiB body bound) about 20 minutes of a core. And the byte bound of
admission (SPEC L5: a prompt whose bytes alone exceed the context is refused before it is
tokenized) now holds for these tokenizers too: it was off for them, so every huge prompt was
tokenized in full first."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import NormalizedString, normalizers

from coda.models.gguf_header import read_header
from coda.models.gguf_spm import _cut, spm_segments
from coda.models.tokenizer_bundle import bundle_from_gguf
from coda.server.admission import PromptBound
from tests.conftest import examples
from tests.spm_vocab_fixture import write_pieces_gguf

PIECES = [("ab", -1.0), ("▁a", -2.0), ("日本", -2.0), ("本", -3.0), ("bé", -3.0),
          ("▁▁", -4.0), ("a", -5.0), ("b", -5.0)]


@settings(max_examples=examples(60), deadline=None)
@given(text=st.text("ab é日本x", min_size=0, max_size=400))
def test_k1_cut_pieces_equal_direct_slices(text: str) -> None:
    """K1: the halving cut yields the same pieces (text and offsets into the original) as
    slicing each segment out of the whole, for texts of any number of segments (the
    recursion starts above 16)."""
    scores = dict(PIECES)
    spans = spm_segments(text, scores)
    whole = NormalizedString(text)
    direct = [whole[a:b] for a, b in spans]
    got: list[NormalizedString | None] = []
    _cut(NormalizedString(text), spans, 0, got)
    assert [str(p) for p in got] == [str(p) for p in direct if p is not None]
    assert "".join(str(p) for p in got) == text


def test_k1_long_text_encodes_as_its_parts(tmp_path: Path) -> None:
    """K1: a text of thousands of segments encodes (ids and offsets) as the concatenation of
    its paragraphs' encodes, each short enough that no halving happens."""
    path = write_pieces_gguf(tmp_path / "v.gguf", PIECES)
    tok = bundle_from_gguf(read_header(path)).tokenizer
    para = "ab 日本 bé x\n"
    ids: list[int] = []
    for _ in range(300):
        ids += tok.encode(para, add_special_tokens=False).ids
    enc = tok.encode(para * 300, add_special_tokens=False)
    assert enc.ids == ids
    step = len(para)
    offsets = tok.encode(para, add_special_tokens=False).offsets
    assert enc.offsets[len(offsets):2 * len(offsets)] == [(a + step, b + step)
                                                          for a, b in offsets]


def test_k1_cutting_a_long_text_is_not_quadratic() -> None:
    """K1 / hostile input: cutting 400,000 characters into 8-character segments takes well
    under a second here (the direct slices took 35 s: 50,000 slices of a 400k string)."""
    n = 400_000
    spans = [(i, min(i + 8, n)) for i in range(0, n, 8)]
    out: list[NormalizedString | None] = []
    start = time.monotonic()
    _cut(NormalizedString("x" * n), spans, 0, out)
    took = time.monotonic() - start
    assert len(out) == len(spans) and str(out[-1]) == "x" * 8
    assert took < 8.0, took  # NOTE: ~1 s on the shared 2-core box; quadratic was ~35 s


pieces_st = st.dictionaries(st.text("ab▁é日本", min_size=1, max_size=4),
                            st.integers(-6, 0).map(float), min_size=1, max_size=30)


@settings(max_examples=examples(40), deadline=None)
@given(pieces=pieces_st, texts=st.lists(st.text("ab é日本x\n", max_size=40), min_size=1,
                                        max_size=4), space_prefix=st.booleans())
def test_l5_spm_prompt_bound_is_certain_and_a_true_lower_bound(
        pieces: dict[str, float], texts: list[str], space_prefix: bool) -> None:
    """L5 (hostile input): a GGUF SentencePiece tokenizer's byte bound is certain, so a
    prompt longer than the context by its bytes alone is refused untokenized; and it never
    exceeds the real count (brute-force oracle: the exact encode), special tokens or not."""
    with tempfile.TemporaryDirectory() as scratch:
        path = write_pieces_gguf(Path(scratch) / "v.gguf", sorted(pieces.items()),
                                 space_prefix)
        tok = bundle_from_gguf(read_header(path)).tokenizer
        bound = PromptBound.of(tok)
        assert bound.certain
        for text in texts + ["<start_of_turn>" + "".join(texts) + "<end_of_turn>"]:
            for special in (True, False):
                assert bound.min_tokens(text) <= len(tok.encode(text,
                                                                add_special_tokens=special).ids)


def test_l5_spm_prompt_bound_not_certain_where_the_normalizer_shortens(tmp_path: Path) -> None:
    """L5: a normalizer step that can shorten the text (a Replace by something shorter, a
    Strip) voids the bound, as for any tokenizer."""
    tok = bundle_from_gguf(read_header(write_pieces_gguf(tmp_path / "v.gguf", PIECES))
                           ).tokenizer
    assert PromptBound.of(tok).certain
    tok.normalizer = normalizers.Sequence([normalizers.Replace("ab", "c")])
    assert not PromptBound.of(tok).certain
    tok.normalizer = normalizers.Strip()
    assert not PromptBound.of(tok).certain
