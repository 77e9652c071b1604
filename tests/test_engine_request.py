"""Issue 22 item 1: the engine keeps one live object per request. The
:class:`~coda.engine.engine_request.EngineRequest` *is* the :class:`~coda.engine.sequence.Sequence` the
scheduler and the block manager move (no second object looked up by id), and its two bases
share no name, so neither can silently overwrite the other's state (L2, L7, T1, T4)."""

from __future__ import annotations

from coda.engine.engine_request import EngineRequest
from coda.engine.plan import ModelLimits, plan_request
from coda.engine.sequence import Sequence
from coda.engine.types import GenerationRequest
from coda.request import RequestRun
from coda.sampling import SamplingParams
from coda.trace import ListTraceSink

from .scripted import scripted_tokenizer


def _request() -> EngineRequest:
    plan = plan_request(GenerationRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(),
                                          max_tokens=4, request_id="r"),
                        ModelLimits(context_length=64, vocab_size=300,
                                    eos_token_ids=frozenset({0})))
    return EngineRequest(plan, 7, scripted_tokenizer({1: b"a", 2: b"b"}), ListTraceSink(),
                         arrival=12.5)


def _names(obj: object) -> set[str]:
    """The instance's attributes and its class's, without Python's own dunders."""
    return {n for n in set(vars(obj)) | set(dir(type(obj))) if not n.startswith("__")}


def test_engine_request_is_its_sequence() -> None:
    req = _request()
    assert isinstance(req, Sequence) and isinstance(req, RequestRun)
    # NOTE: both bases initialised: the run's arrival time and the sequence's token state
    assert (req.seq_id, req.prompt_token_ids, req.max_total_tokens) == (7, [1, 2], 6)
    assert (req.arrival, req.admitted, req.num_computed_tokens, req.block_table) == (
        12.5, -1, 0, [])
    assert req.request_id == "r" and req.plan.max_tokens == 4


def test_the_two_bases_share_no_name() -> None:
    run = RequestRun("x", None, ListTraceSink(), prompt_tokens=1, arrival=1.0)
    seq = Sequence(1, [1], 2)
    assert _names(run) & _names(seq) == set()
    # and the engine request has every name of both, with nothing of its own shadowing them
    req = _request()
    assert _names(run) | _names(seq) <= _names(req)
