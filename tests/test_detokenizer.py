"""Incremental detokenizer against tokenizer.decode over real tokenizers (SPEC K1-K4, G2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from coda import detokenizer, detokenizer_profile
from coda.detokenizer import IncrementalDetokenizer
from coda.errors import DecodingError
from tests.conftest import examples
from tests.tokenizer_fixtures import ALL_FAMILIES, SPECIAL_TOKENS

FAMILIES = sorted(ALL_FAMILIES)
BYTE_FAMILIES = ["byte_level_bpe", "sentencepiece_bpe", "metaspace_bpe"]
SPACE_FAMILIES = ["sentencepiece_bpe", "metaspace_bpe"]
FFFD = "\ufffd"


def _byte_ids(tok: Tokenizer) -> list[int]:
    """Ids of the 256 single-byte tokens, indexed by byte value ([] for a text-only family)."""
    vocab = tok.get_vocab()
    if "<0x00>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in range(256)]
    if b"ByteLevel" not in tok.decoder.__getstate__():
        return []
    # NOTE: GPT-2 alphabet: printable bytes are themselves, the rest are shifted past 255.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    shifted = [b for b in range(256) if b not in keep]
    char = {b: chr(b) for b in keep} | {b: chr(256 + k) for k, b in enumerate(shifted)}
    return [vocab[char[b]] for b in range(256)]


def _ids_strategy(tok: Tokenizer) -> st.SearchStrategy[int]:
    """Random ids biased to byte tokens, specials and U+FFFD so partial characters occur."""
    specials = [tok.get_vocab()[t] for t in SPECIAL_TOKENS]
    interesting = specials + tok.encode("\ufffd 😀 日本 é").ids
    byte_ids = _byte_ids(tok)
    parts = [st.integers(0, tok.get_vocab_size() - 1), st.sampled_from(interesting)]
    if byte_ids:
        tricky = [byte_ids[b] for b in (0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0x41)]
        parts += [st.sampled_from(byte_ids), st.sampled_from(tricky)]
    return st.one_of(*parts)


def _prompt_strategy(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Prompts, often ending in a byte-token run: a whole character ("Hello 中" as bytes), a
    partial one, an emoji, or ASCII spelt as byte tokens (SentencePiece byte fallback)."""
    ids_st = _ids_strategy(tok)
    byte_ids = _byte_ids(tok)
    if not byte_ids:
        return st.lists(ids_st, max_size=12)
    runs = [b"\xe4\xb8\xad", b"\xe4\xb8", b"\xf0\x9f\x98\x80", b"k", b"ok", b"\xf0",
            "é日".encode()]
    run_st = st.one_of(st.sampled_from(runs), st.binary(max_size=4))
    return st.builds(lambda head, run: head + [byte_ids[b] for b in run],
                     st.lists(ids_st, max_size=10), run_st)


def _run(
    tok: Tokenizer, ids: list[int], skip: bool, prompt: list[int]
) -> tuple[list[bytes], bytes | None]:
    """Push ids; return the chunks and finish()'s bytes (None when finish raised, K3)."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_token_ids=prompt)
    chunks = [det.push(i) for i in ids]
    try:
        return chunks, det.finish()
    except DecodingError:
        return chunks, None


def expected_output(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    """The byte oracle of K2/K4 (docs/api.md "The first output bytes"): decode(prompt + out)
    after its longest common prefix with decode(prompt). When the prompt's rendering is a prefix
    (the usual case) that is exactly the text after the prompt; when the output re-renders the
    prompt's end (completes its partial character, extends its byte run, or a cleanup rule spans
    the boundary) the re-rendered characters come first, whole."""
    before = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + ids, skip_special_tokens=skip)
    k = 0
    for a, b in zip(before, full, strict=False):
        if a != b:
            break
        k += 1
    return full[k:]


def _check_against_oracle(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> None:
    chunks, final = _run(tok, ids, skip, prompt)
    for chunk in chunks:
        chunk.decode("utf-8")  # NOTE: strict: every chunk is valid text on its own (K3)
    emitted = b"".join(chunks)
    want = expected_output(tok, prompt, ids, skip).encode()
    if final is not None:
        assert emitted + final == want
    else:  # K3: a trailing partial character: decode() shows it as U+FFFD, finish() raises
        # NOTE: the rest may be empty when the prompt's own U+FFFD already covers that tail
        assert ids and want.startswith(emitted)
        assert set(want[len(emitted) :].decode()) <= {FFFD}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_k2_k3_incremental_equals_batch_decode(family: str, skip: bool) -> None:
    """K2: concat(emitted)+finish() == decode(all); K3: chunks are whole UTF-8 characters and a
    trailing partial character makes finish() raise, leaving decode() minus its U+FFFD tail.
    Half the cases run after a prompt that may end in a byte-fallback run (K4)."""
    tok = ALL_FAMILIES[family]()

    @settings(deadline=None, max_examples=examples(120))
    @given(st.lists(_ids_strategy(tok), max_size=50),
           st.one_of(st.just([]), _prompt_strategy(tok)))
    def check(ids: list[int], prompt: list[int]) -> None:
        _check_against_oracle(tok, prompt, ids, skip)

    check()


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_k2_k4_prompt_context_bytes_follow_the_prompts_decode(family: str, skip: bool) -> None:
    """K2, K4: with prompt ids (often ending in a byte-fallback run), the output bytes are those
    of decode(prompt+out) after decode(prompt): the prompt's tail is never echoed."""
    tok = ALL_FAMILIES[family]()

    @settings(deadline=None, max_examples=examples(80))
    @given(_prompt_strategy(tok), st.lists(_ids_strategy(tok), max_size=30))
    def check(prompt: list[int], ids: list[int]) -> None:
        _check_against_oracle(tok, prompt, ids, skip)

    check()


@pytest.mark.parametrize("family", BYTE_FAMILIES)
@pytest.mark.parametrize("prompt_text", ["Hello 中", "ok", "Hi 😀"])
def test_k2_k4_prompt_ending_in_a_byte_run_is_not_echoed(family: str, prompt_text: str) -> None:
    """K2, K4 (issue 8 defect 1): a prompt ending in byte tokens that form whole characters:
    the output is " the fox", not the prompt's run again followed by " the fox"."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    head, run = prompt_text[:-1], prompt_text[-1].encode()
    prompt = tok.encode(head).ids + [byte_ids[b] for b in run] if head else \
        [byte_ids[b] for b in prompt_text.encode()]
    out = tok.encode(" the fox").ids
    if family != "byte_level_bpe":
        out = [i for i in out if tok.id_to_token(i) != "▁"] or out  # NOTE: no lone prefix ▁
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    got = b"".join(det.push(i) for i in out) + det.finish()
    assert got == expected_output(tok, prompt, out, True).encode()
    assert run not in got


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_k3_k4_output_completing_the_prompts_partial_character_emits_it_whole(
        family: str) -> None:
    """K3, K4: the prompt ends inside 中 (``E4 B8``); the output's ``AD`` completes it: the first output
    bytes are the whole character (docs/api.md), never a lone continuation byte. With no output
    the prompt's residue is context, not a decoding error."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    prompt = tok.encode("Hi").ids + [byte_ids[0xE4], byte_ids[0xB8]]
    tail = tok.encode("x").ids
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    got = b"".join(det.push(i) for i in [byte_ids[0xAD], *tail]) + det.finish()
    assert got.startswith("中".encode())
    assert got == expected_output(tok, prompt, [byte_ids[0xAD], *tail], True).encode()
    assert IncrementalDetokenizer(tok, prompt_token_ids=prompt).finish() == b""


@pytest.mark.parametrize("family", FAMILIES)
def test_k3_genuine_replacement_char_is_emitted_at_once(family: str) -> None:
    """K3: a real U+FFFD token is text, not a pending byte: it is not held back."""
    tok = ALL_FAMILIES[family]()
    ids = tok.encode("ab \ufffd").ids
    det = IncrementalDetokenizer(tok)
    chunks = [det.push(i) for i in ids]
    assert chunks[-1].endswith(FFFD.encode()) and det.pending == b""
    assert b"".join(chunks) + det.finish() == tok.decode(ids).encode()


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_k3_four_byte_emoji_split_across_byte_tokens_waits(family: str) -> None:
    """K3: F0 9F 98 80 pushed byte by byte emits nothing until the emoji is complete.

    Byte-level BPE emits it with its last byte. A byte-fallback run is decoded as one group
    (decode() turns a whole invalid run into U+FFFD per byte), so the run is final only when a
    text token closes it (or at finish()): that holds a complete character a little longer."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    prompt = tok.encode("ok").ids
    raw = "😀".encode()
    for closer in ([], [tok.get_vocab()["e"]]):
        det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
        for k, b in enumerate(raw[:-1]):
            assert det.push(byte_ids[b]) == b""
            assert det.pending.endswith(raw[: k + 1])
            assert det.snapshot()["pending_hex"] == det.pending.hex()
        last = det.push(byte_ids[raw[-1]])
        if family == "byte_level_bpe":
            assert last.endswith(raw) and det.pending == b""
            continue
        assert last == b"" and det.pending.endswith(raw)
        rest = det.push(closer[0]) if closer else det.finish()
        assert raw in rest and det.pending == b""
        full = tok.decode(prompt + [byte_ids[b] for b in raw] + closer)
        assert full.encode().endswith(rest)


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_k3_invalid_middle_bytes_become_replacement_like_decode(family: str) -> None:
    """Declared interface: a broken sequence followed by text is emitted as decode() shows it."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    ids = [byte_ids[0x41], byte_ids[0xE4], byte_ids[0xB8], *tok.encode("x").ids]
    det = IncrementalDetokenizer(tok)
    out = b"".join(det.push(i) for i in ids)
    assert FFFD.encode() in out and out + det.finish() == tok.decode(ids).encode()
    broken = [byte_ids[0x41], byte_ids[0xE4], byte_ids[0x41]]  # NOTE: `E4 41` can never complete
    det = IncrementalDetokenizer(tok)
    out = b"".join(det.push(i) for i in broken)
    assert out == tok.decode(broken).encode() and det.pending == b""  # NOTE: not held


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_k3_finish_on_partial_character_raises(family: str) -> None:
    """K3: residue that cannot form valid text at finish() is a DecodingError, recorded (K2)."""
    tok = ALL_FAMILIES[family]()
    det = IncrementalDetokenizer(tok)
    det.push(tok.encode("hi").ids[-1])
    det.push(_byte_ids(tok)[0xE4])
    with pytest.raises(DecodingError):
        det.finish()
    assert det.removed_spans[-1].reason == "invalid_residue"


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_g2_discard_pending_drops_partial_character(family: str) -> None:
    """G2: after a stop hit the held tail is dropped, returned, recorded; nothing more is emitted."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    det = IncrementalDetokenizer(tok)
    text_ids = [tok.get_vocab()[c] for c in "ea"]
    out = b"".join(det.push(i) for i in text_ids)
    assert det.push(byte_ids[0xF0]) == b"" and det.push(byte_ids[0x9F]) == b""
    assert det.discard_pending() == b"\xf0\x9f"
    assert det.pending == b"" and det.removed_spans[-1].reason == "pending_discarded"
    assert out == tok.decode(text_ids).encode()
    with pytest.raises(RuntimeError):
        det.push(byte_ids[0x41])


@pytest.mark.parametrize("family", SPACE_FAMILIES)
def test_k4_metaspace_leading_space_matches_decode(family: str) -> None:
    """K4: the first output token's ▁ is dropped without context and kept after a prompt."""
    tok = ALL_FAMILIES[family]()
    word = next(i for t, i in sorted(tok.get_vocab().items()) if t.startswith("▁") and len(t) > 2)
    alone = IncrementalDetokenizer(tok)
    first = alone.push(word)
    assert first == tok.decode([word]).encode() and not first.startswith(b" ")
    assert alone.removed_spans[0].reason == "leading_space_cleanup"
    prompt = tok.encode("Hi").ids
    ctx = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    with_prompt = ctx.push(word)
    assert with_prompt.startswith(b" ") and ctx.removed_spans == []  # NOTE: decode keeps it
    full, base = tok.decode(prompt + [word]), tok.decode(prompt)
    assert with_prompt == full[len(base) :].encode()
    only_bos = IncrementalDetokenizer(tok, prompt_token_ids=[tok.get_vocab()["<s>"]])
    assert only_bos.push(word) == first  # NOTE: a skipped <s> gives no context


@pytest.mark.parametrize("family", FAMILIES)
def test_k2_skipped_special_tokens_are_recorded(family: str) -> None:
    """K2: control tokens removed by skip_special_tokens appear in removed_spans."""
    tok = ALL_FAMILIES[family]()
    eos = tok.get_vocab()["</s>"]
    det = IncrementalDetokenizer(tok)
    assert det.push(eos) == b""
    assert det.removed_spans[0].reason == "special_token_skipped"
    assert det.removed_spans[0].data == b"</s>" and det.removed_spans[0].index == 0
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert kept.push(eos) == tok.decode([eos], skip_special_tokens=False).encode()


@pytest.mark.parametrize("family", FAMILIES)
def test_k1_history_suffix_stays_bounded(family: str) -> None:
    """K1: the kept token history is a bounded suffix (O(1) per token), output stays exact."""
    tok = ALL_FAMILIES[family]()
    ids = tok.encode("Café 日本語 😀 the fox. " * 40).ids
    det = IncrementalDetokenizer(tok)
    out, longest = b"", 0
    for i in ids:
        out += det.push(i)
        longest = max(longest, int(str(det.snapshot()["history_suffix_len"])))
    assert out + det.finish() == tok.decode(ids).encode()
    assert longest <= 16


@pytest.fixture(autouse=True)
def _fresh_profiles() -> None:
    """Each test builds its tokenizer profiles itself (K1), so a profile computed once for the
    whole session cannot hide a defect in building one."""
    detokenizer._PROFILES.clear()


def test_k2_byte_level_alphabet_is_gpt2s_byte_to_unicode_map() -> None:
    """K2: the byte view of byte-level BPE tokens uses GPT-2's reversible map: printable
    Latin-1 bytes map to themselves, the other 68 bytes to U+0100 onwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    want = {chr(b): b for b in printable} | {chr(0x100 + k): b for k, b in enumerate(others)}
    assert detokenizer_profile._byte_level_table() == want and len(want) == 256


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_k1_k2_discarded_tail_and_unknown_ids_are_recorded_exactly(family: str) -> None:
    """K1, K2, G2: a discarded tail is one removed span (index and token -1: not one token's)
    after which the snapshot shows everything emitted; an id outside the vocabulary is an
    unknown_token_id span at its output index."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    det = IncrementalDetokenizer(tok)
    det.push(tok.get_vocab()["e"])
    det.push(10**6)  # NOTE: not a token id: decode() ignores it
    det.push(byte_ids[0xE4])
    assert det.discard_pending() == b"\xe4"
    unknown, dropped = det.removed_spans[-2:]
    assert (unknown.reason, unknown.index, unknown.token_id) == ("unknown_token_id", 1, 10**6)
    assert (dropped.reason, dropped.index, dropped.token_id) == ("pending_discarded", -1, -1)
    state = det.snapshot()["cleanup_state"]
    assert isinstance(state, dict) and state["emitted_chars"] == state["window_chars"]
    assert state["closed"] is True and det.snapshot()["pending_hex"] == ""


@pytest.mark.parametrize("family", BYTE_FAMILIES)
def test_k2_k3_finish_closes_and_records_an_invalid_residue_as_not_one_tokens(
        family: str) -> None:
    """K2, K3: finish() closes the detokenizer (a later push raises), leaves nothing unemitted
    in the snapshot, and records an invalid residue with index and token -1."""
    tok = ALL_FAMILIES[family]()
    det = IncrementalDetokenizer(tok)
    det.push(tok.get_vocab()["e"])
    assert det.finish() == b""
    state = det.snapshot()["cleanup_state"]
    assert isinstance(state, dict) and state["closed"] is True
    assert state["emitted_chars"] == state["window_chars"]
    with pytest.raises(RuntimeError):
        det.push(tok.get_vocab()["e"])
    bad = IncrementalDetokenizer(tok)
    bad.push(_byte_ids(tok)[0xE4])
    with pytest.raises(DecodingError):
        bad.finish()
    span = bad.removed_spans[-1]
    assert (span.reason, span.index, span.token_id, span.data) == ("invalid_residue", -1, -1,
                                                                   b"\xe4")


@pytest.mark.parametrize("family", SPACE_FAMILIES)
def test_k4_only_the_first_rendered_token_loses_its_leading_space(family: str) -> None:
    """K4, K2: one leading_space_cleanup span, for the first rendered output token only."""
    tok = ALL_FAMILIES[family]()
    words = [i for t, i in sorted(tok.get_vocab().items()) if t.startswith("▁") and len(t) > 2]
    det = IncrementalDetokenizer(tok)
    out = b"".join(det.push(i) for i in words[:3]) + det.finish()
    assert out == tok.decode(words[:3]).encode()
    spans = [s for s in det.removed_spans if s.reason == "leading_space_cleanup"]
    assert [s.index for s in spans] == [0]


def test_k4_a_tokenizer_without_the_space_rule_records_no_space_cleanup() -> None:
    """K4: a "▁" token of a tokenizer whose decoder keeps it (no Metaspace/Strip) is text."""
    from tokenizers import models

    tok = Tokenizer(models.WordLevel({"▁x": 0, "y": 1, "[UNK]": 2}, unk_token="[UNK]"))
    det = IncrementalDetokenizer(tok)
    assert det.push(0) == tok.decode([0]).encode() and det.removed_spans == []


@pytest.mark.parametrize("family", ["sentencepiece_bpe", "metaspace_bpe"])
def test_k1_k2_long_byte_run_continuing_the_prompts_run(family: str) -> None:
    """K1, K2: the prompt's byte run stays open across more output byte tokens than the
    window's cut length; the output is exactly the oracle's (nothing of the prompt again,
    nothing lost)."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    prompt = tok.encode("the quick brown fox").ids + [byte_ids[b] for b in "中".encode()]
    out = [byte_ids[b] for b in "文字語".encode()] + tok.encode(" ok").ids
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    got = b"".join(det.push(i) for i in out) + det.finish()
    assert got == expected_output(tok, prompt, out, True).encode()
    assert got.startswith("文字語".encode())


@pytest.mark.parametrize("family", SPACE_FAMILIES)
def test_k1_g2_finish_drains_a_held_run_and_leaves_nothing_unemitted(family: str) -> None:
    """K1, G2: a valid byte run held to the end is what finish() returns, after which the
    snapshot shows every character emitted and nothing pending."""
    tok = ALL_FAMILIES[family]()
    byte_ids = _byte_ids(tok)
    det = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Hi").ids)
    assert b"".join(det.push(byte_ids[b]) for b in "中".encode()) == b""
    assert det.finish() == "中".encode()
    snap = det.snapshot()
    state = snap["cleanup_state"]
    assert isinstance(state, dict) and state["emitted_chars"] == state["window_chars"]
    assert snap["pending_hex"] == ""
