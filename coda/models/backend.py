"""The model's backend, chosen once at load (issue 18 item 6).

:func:`resolve_backend` is mode resolution as the loader uses it: the serving mode
(:class:`~coda.models.modes.QuantMode`, the linear factory: how every matrix is held and
multiplied) together with the decoder's row ops (native or torch, :mod:`coda.models.row_ops`)
as one frozen :class:`Backend`. The model takes its row ops at construction and runs one layer
loop over them; the load summary prints the backend's state (the native ISA and summation order,
the kernel of each tensor type, which row ops run and why). Torch-free at import, like the mode
table, so ``coda models`` and mode resolution load no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coda.models.config import ModelConfig
from coda.models.gguf_file import GGUFCheckpoint
from coda.models.modes import QuantMode, resolve_mode

if TYPE_CHECKING:
    from coda.models.llama import CausalLM
    from coda.models.row_ops import RowOps


@dataclass(frozen=True)
class Backend:
    """What the model runs on, chosen once at load (issue 18 item 6): ``mode`` is the linear
    factory (how every matrix is held and multiplied: its builders make each projection's
    module), ``rows`` the decoder's row ops (:data:`~coda.models.row_ops.NATIVE_ROWS` or
    :data:`~coda.models.row_ops.TORCH_ROWS`), ``rows_note`` which of them and why. The model
    takes ``rows`` at construction; nothing re-chooses them per layer or per step."""

    mode: QuantMode
    rows: RowOps
    rows_note: str
    rope: str | None = None  # a RoPE choice made at load (ModelConfig.rope_choice)

    def load_gguf(self, ckpt: GGUFCheckpoint, device: str) -> CausalLM:
        return self.mode.build_gguf(ckpt, device, self.rows)

    def load_folder(self, path: Path, device: str,
                    config: ModelConfig | None = None) -> CausalLM:
        return self.mode.load_folder(path, device, self.rows, config)

    def summary(self, per_type: Mapping[str, str]) -> dict[str, str | bool]:
        """The load summary's part (O1): the mode, the native kernels' state (the ISA that
        runs, or why none does), the row ops and why, and as ``kernels`` ``per_type``: which
        kernel runs each tensor type (the model's record, ``CausalLM.kernels``; empty for
        torch's dense)."""
        return {**self.mode.summary(), "row_ops": self.rows_note,
                "kernels": ", ".join(f"{k}: {v}" for k, v in per_type.items()),
                **({"rope": self.rope} if self.rope else {})}

    def describe(self, per_type: Mapping[str, str]) -> list[str]:
        """The same as lines for the CLI's start-up output."""
        s = self.summary(per_type)
        order_part = f", order {s['kernel_order']}" if "kernel_order" in s else ""
        return [f"kernels: native {s['native_kernels']}{order_part}",
                f"kernel per tensor type: {s['kernels'] or 'torch (F.linear / torch ops)'}",
                *([f"rope: {self.rope}"] if self.rope else [])]


def resolve_backend(quant: str, dtype: str | None, ckpt: GGUFCheckpoint | None,
                    config: ModelConfig, device: str = "cpu") -> Backend:
    """Mode resolution for loading: :func:`resolve_mode`'s mode and the row ops a model of
    ``config`` (as served: :meth:`ModelConfig.serving`) runs in that mode's dtype on
    ``device`` (native unless
    :func:`coda.models.attention.native_attention_refusal` says why not)."""
    mode = resolve_mode(quant, dtype, ckpt)
    from coda.models.row_ops import rows_for  # NOTE: torch, only once weights load

    rows, note = rows_for(config, mode.dtype, device)
    return Backend(mode, rows, note, config.rope_choice())
