"""Draft/target pairs for the draft-model tests (issue 21 item 2): a model cut to its first
layers, written in its own format (an HF folder or a GGUF file), shares the target's tokenizer
and agrees with it often enough that drafts are both accepted and rejected."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file, save_file

from tests.kquant_files import writer_like

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


def cut_hf(src: Path, dst: Path, layers: int) -> Path:
    """``src`` (an HF folder) with only its first ``layers`` decoder layers."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
               if (m := _HF_LAYER.match(k)) is None or int(m.group(1)) < layers}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def cut_gguf(src: Path, dst: Path, layers: int | Sequence[int]) -> Path:
    """``src`` (a GGUF file) with only its first ``layers`` blocks (or the blocks listed, in
    order, renumbered from 0), tensors kept as stored (same quantization), every other
    metadata field copied."""
    keep = list(range(layers)) if isinstance(layers, int) else list(layers)
    new_index = {old: new for new, old in enumerate(keep)}
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    w = writer_like(reader, dst, {f"{arch}.block_count": len(keep)})
    for t in reader.tensors:
        m = _GGUF_LAYER.match(t.name)
        if m is None:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        elif int(m.group(1)) in new_index:
            name = f"blk.{new_index[int(m.group(1))]}.{t.name[m.end():]}"
            w.add_tensor(name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
