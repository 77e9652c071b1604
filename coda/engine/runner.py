"""ModelRunner: one batched forward step over the paged KV cache (SPEC T1, T3, T4).

The engine hands :meth:`ModelRunner.execute` one :class:`SeqChunk` per scheduled sequence;
each chunk's K/V are appended at logical positions ``start_pos ..`` through the sequence's
block table, and the next-token logits of the chunks that ask for them come back, in chunk
order, as float32. Chunks of different sequences never share a block written in this step
(the block manager guarantees it), so one flattened forward serves prefill chunks and decode
tokens of sequences with different cache lengths together (T3, T4).

Threads (``torch.set_num_threads`` is process-wide, so the caller's choice always wins):
``num_threads=N`` sets N. Left at ``None``, the runner changes nothing if ``OMP_NUM_THREADS``
is set or the thread count was already changed from the value torch had when this module was
imported; otherwise it uses one fewer than the CPUs this process may run on (at least 1),
leaving a core to the event loop, detokenizer and HTTP server. Measured (issue 10,
``benchmarks/bench_threads.py``, SmolLM2-135M fp32, context 128, the 2-core EPYC shared with
other jobs at load 8–10): a decode step at batch 1/8/32 took 176/403/1052 ms with 1 thread and
1712/2980/7784 ms with 2 — 7–10× slower, since an OpenMP barrier waits for whichever thread
the OS has descheduled. On an idle machine 2 threads gained 5%/26%/48% (issue 10's table,
bf16). A server always has other work on the cores, and the loss when they are busy dwarfs
the gain when they are idle, so the default stays at cores − 1 (``--threads`` overrides it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from coda.models.attention import AttentionMetadata, PagedKVCache, native_attention_refusal
from coda.models.config import ModelConfig
from coda.models.llama import CausalLM
from coda.models.loader import load_model, torch_dtype

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
_THREADS_AT_IMPORT = torch.get_num_threads()


def choose_num_threads(requested: int | None) -> None:
    """Apply the thread policy of the module docstring, to torch's pool and to the native
    kernels' own pool (coda/models/kernels; issue 18) alike."""
    from coda.models.kernels import set_threads

    if requested is not None:
        torch.set_num_threads(requested)
    elif "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() == _THREADS_AT_IMPORT:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    set_threads(torch.get_num_threads())


@dataclass(frozen=True)
class SeqChunk:
    """The tokens one sequence processes in this step.

    ``token_ids`` are the tokens whose K/V are computed now (a prefill chunk or the one decode
    token); ``start_pos`` is the logical position of ``token_ids[0]`` (== tokens already in the
    cache); ``block_table`` covers positions ``[0, start_pos + len(token_ids))``. With
    ``need_logits``, the logits of the chunk's last ``num_logits`` tokens come back (more than
    one: a speculative verification, coda.engine.speculative).
    """

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    need_logits: bool
    num_logits: int = 1


class ModelRunner:
    """Owns the model and its paged KV cache; runs one step per :meth:`execute` call."""

    def __init__(
        self,
        model: CausalLM,
        *,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        num_threads: int | None = None,
        invariant_attention: bool = True,
        native_attention: bool | None = None,
    ) -> None:
        choose_num_threads(num_threads)
        # NOTE: False = plain SDPA attention: not batch invariant (T4); a measured opt-out.
        self.invariant_attention = invariant_attention
        self.model = model
        self.config: ModelConfig = model.config
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_bytes_per_token: int = self.config.kv_bytes_per_token(dtype)
        if num_blocks is None:
            budget = kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
            num_blocks = budget // (self.kv_bytes_per_token * block_size)
        if num_blocks < 1:
            raise ValueError("KV cache budget is smaller than one block")
        self.num_blocks: int = num_blocks
        self.kv = PagedKVCache(
            num_layers=self.config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=torch_dtype(dtype),
            device=self.device,
        )
        self.forward_time_s: float = 0.0
        # NOTE: one attention implementation for the runner's life: the native kernel and the
        # torch path are each batch invariant (T4) but round differently, so never mix them.
        refusal = (native_attention_refusal(self.config, torch_dtype(dtype), self.device)
                   if invariant_attention and native_attention is not False else "turned off")
        if native_attention and refusal is not None:
            raise ValueError(f"native attention unavailable: {refusal}")
        self.native_attention: bool = refusal is None
        self.attention_note = "native row kernel" if refusal is None else f"torch ({refusal})"

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        num_threads: int | None = None,
    ) -> ModelRunner:
        """Load ``model_dir`` (HF layout); size the cache by ``num_blocks`` or bytes (256 MiB)."""
        return cls(
            load_model(model_dir, dtype=dtype, device=device),
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_bytes=kv_cache_bytes,
            num_threads=num_threads,
        )

    def _check(self, chunk: SeqChunk) -> None:
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids or chunk.start_pos < 0:
            raise ValueError("a chunk needs >= 1 token and start_pos >= 0")
        if end > self.config.max_context:
            raise ValueError(f"position {end - 1} exceeds max_context {self.config.max_context}")
        if len(chunk.block_table) * self.block_size < end:
            raise ValueError(f"block table too short for {end} tokens")
        table = chunk.block_table
        # NOTE: min/max run in C; a per-id Python check cost ~5 µs per sequence per step.
        if table and (min(table) < 0 or max(table) >= self.num_blocks):
            raise ValueError(f"block id out of range [0, {self.num_blocks})")

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Run one step; float32 logits ``[sum of num_logits over chunks with need_logits,
        vocab]`` in chunk order."""
        vocab = self.config.vocab_size
        if not chunks:
            return torch.empty((0, vocab), dtype=torch.float32)
        for chunk in chunks:
            self._check(chunk)
        ids = [t for c in chunks for t in c.token_ids]
        q_lens = [len(c.token_ids) for c in chunks]
        meta = AttentionMetadata.build(
            q_lens,
            [c.start_pos + n for c, n in zip(chunks, q_lens, strict=True)],
            [c.block_table for c in chunks],
            self.block_size,
            self.device,
            invariant=self.invariant_attention,
            kernel=self.native_attention,
        )
        # NOTE: the last flat token of chunk b is query_start[b] + q_b - 1.
        last_rows: list[int] = []
        offset = 0
        for chunk, n in zip(chunks, q_lens, strict=True):
            offset += n
            if chunk.need_logits:
                last_rows.extend(range(offset - min(chunk.num_logits, n), offset))
        with torch.inference_mode():
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            start = time.perf_counter()
            hidden = self.model(input_ids, meta.positions, meta, self.kv)
            if not last_rows:
                self.forward_time_s = time.perf_counter() - start
                return torch.empty((0, vocab), dtype=torch.float32)
            # NOTE: rows ascend, so as many as tokens means every row (a decode-only step):
            # the head reads the hidden states themselves, not an identical copy
            last = hidden if len(last_rows) == len(ids) else hidden.index_select(
                0, torch.tensor(last_rows, dtype=torch.long, device=self.device))
        # NOTE: the LM head runs outside inference mode (no_grad instead), so the logits are an
        # ordinary tensor that callers may edit in place, without a copy.
        with torch.no_grad():
            logits = self.model.compute_logits(last).float()
        self.forward_time_s = time.perf_counter() - start
        return logits.cpu()

    def embed_scratch(self, n: int) -> PagedKVCache:
        """The scratch KV cache of an embedding of ``n`` tokens (coda.engine.embed_job): sized
        for it alone, so the engine's cache, its prefix entries and the sequences in it are
        untouched. A bad ``n`` raises ValueError."""
        if n == 0:
            raise ValueError("an embedding needs at least one token")
        if n > self.config.max_context:
            raise ValueError(f"{n} tokens exceed max_context {self.config.max_context}")
        return PagedKVCache(
            num_layers=self.config.num_layers, num_blocks=-(-n // self.block_size),
            block_size=self.block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, dtype=self.kv.k[0].dtype, device=self.device)

    def embed_rows(self, scratch: PagedKVCache, token_ids: Sequence[int], start: int,
                   end: int) -> torch.Tensor:
        """The model's last hidden state (after the final norm, before the LM head) of
        ``token_ids[start:end]``, positions ``start ..`` of one embedding whose earlier K/V
        are in ``scratch``: one chunk of a chunked prefill over the scratch cache. Run it
        where :meth:`execute` runs (the engine thread): the native kernels' thread pool
        serves one caller at a time."""
        table = tuple(range(-(-end // self.block_size)))
        meta = AttentionMetadata.build([end - start], [end], [table], self.block_size,
                                       self.device, invariant=self.invariant_attention,
                                       kernel=self.native_attention)
        with torch.inference_mode():
            input_ids = torch.tensor(list(token_ids[start:end]), dtype=torch.long,
                                     device=self.device)
            hidden: torch.Tensor = self.model(input_ids, meta.positions, meta, scratch)
        return hidden

    @staticmethod
    def embed_pool(rows: Sequence[torch.Tensor]) -> list[float]:
        """The mean of an embedding's hidden rows (:meth:`embed_rows`, in order), summed in
        float64 over every row at once, so the mean of a long prompt does not drift and does
        not depend on how its rows were chunked; float32 values."""
        with torch.inference_mode():
            pooled = torch.cat(list(rows)).double().mean(dim=0).float()
        return [float(x) for x in pooled.cpu().tolist()]
