"""Adapters that run the single-request reference loop (:mod:`tests.reference_loop`) on the real
model runner and sampler, so the batched engine can be checked against it token for token
(issue 3 item 5: the reference loop is the engine's oracle)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coda.engine.kv_cache import blocks_needed
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.sampler import Sampler, SamplingRow
from coda.sampling import SamplingParams
from coda.stream import TokenInfo
from tests.reference_loop import Choice


class RunnerModel:
    """The loop's ``Model`` over a :class:`ModelRunner`: one sequence, blocks 0..n-1."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.table: tuple[int, ...] = ()
        self.released = 0

    def _table(self, n_tokens: int) -> tuple[int, ...]:
        need = blocks_needed(n_tokens, self.runner.block_size)
        if need > self.runner.num_blocks:
            raise RuntimeError("sequence does not fit the reference runner's cache")
        return tuple(range(need))

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        self.table = self._table(len(token_ids))
        return self.runner.execute([SeqChunk(tuple(token_ids), 0, self.table, True)])[0]

    def decode_one(self, token_id: int, position: int) -> torch.Tensor:
        self.table = self._table(position + 1)
        return self.runner.execute([SeqChunk((token_id,), position, self.table, True)])[0]

    def release(self) -> None:
        self.released += 1


class SamplerChooser:
    """The loop's ``Chooser`` over the batched :class:`Sampler` with a batch of one."""

    def __init__(self, params: SamplingParams, seed: int, prompt: Sequence[int],
                 eos_token_ids: frozenset[int]) -> None:
        self.params, self.seed, self.prompt, self.eos = params, seed, list(prompt), eos_token_ids
        self.sampler = Sampler()

    def choose(self, logits: torch.Tensor, step: int, output_ids: Sequence[int]) -> Choice:
        row = SamplingRow(self.params, self.seed, step, self.prompt, list(output_ids[:step]),
                          self.eos)
        dec = self.sampler.sample(logits[None, :], [row])[0]
        info = (TokenInfo(dec.token_id, dec.logprob, dec.top_logprobs)
                if self.params.logprobs is not None else TokenInfo(dec.token_id))
        return Choice(dec.token_id, info, dec.to_record(), dec.prob)
