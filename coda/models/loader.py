"""Load HF ``*.safetensors`` weights into :class:`~coda.models.llama.CausalLM`.

Reads a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
with ``safetensors`` directly (``transformers`` is not a runtime dependency). HF tensor names
map one-to-one onto our parameters except the fused projections, which the table below
places into row ranges. Every expected tensor must be present with its exact shape; unknown
tensors are an error (a silently ignored weight would be a silently wrong model).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from coda.models.config import ModelConfig, ModelLoadError, hf_tensor_shapes
from coda.models.llama import CausalLM
from coda.models.row_ops import RowOps

# HF projection name -> (our fused module, which shard)
_FUSED: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def param_target(cfg: ModelConfig, hf_name: str) -> tuple[str, slice | None]:
    """Our parameter name for an HF tensor name, and the row range it fills (fused only)."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
            rows = {
                "q": slice(0, q),
                "k": slice(q, q + kv),
                "v": slice(q + kv, q + 2 * kv),
                "gate": slice(0, f),
                "up": slice(f, 2 * f),
            }[shard]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), rows
    return hf_name, None


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {model_dir}")
    out: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                out.update({name: path for name in fh.keys()})  # noqa: SIM118 (not a dict)
        except (OSError, SafetensorError) as exc:  # NOTE: a damaged or truncated header
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
    return out


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    *,
    rows: RowOps | None = None,
    config: ModelConfig | None = None,
) -> CausalLM:
    """Build the model for ``model_dir/config.json`` (or ``config``, the folder's as served:
    :meth:`ModelConfig.serving`) and fill it from its safetensors; ``rows``: the backend's row
    ops (:class:`~coda.models.backend.Backend`; None: :func:`coda.models.row_ops.default_rows`)."""
    model_dir = Path(model_dir)
    cfg = config if config is not None else ModelConfig.from_dir(model_dir)
    expected = hf_tensor_shapes(cfg)
    files = _tensor_files(model_dir)
    missing = sorted(set(expected) - set(files))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {missing[:5]} ...")
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name.endswith(_IGNORED_SUFFIXES) or (
            name == "lm_head.weight" and cfg.tie_word_embeddings
        ):
            continue  # NOTE: some tied checkpoints still store a copy of the embeddings
        if name not in expected:
            raise ValueError(f"unexpected tensor {name!r} in {path.name}")
        by_file.setdefault(path, []).append(name)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as fh:
                for name in names:
                    yield name, fh.get_tensor(name)

    return build_model(cfg, tensors(), dtype=dtype, device=device, rows=rows)


def build_model(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    modules: Mapping[str, nn.Module] | None = None,
    rows: RowOps | None = None,
) -> CausalLM:
    """A :class:`CausalLM` for ``cfg`` in ``dtype`` on ``device``, every parameter filled from
    ``(hf_name, tensor)`` pairs (any float dtype; cast on copy). Each expected tensor must come
    exactly once with its exact shape; a missing, unknown or repeated one is a ValueError.

    ``modules``: ready-built submodules by our module path (``model.layers.0.mlp.down_proj``)
    or ``"logits_head"`` (the packed LM head): they replace the dense ones, keep their own
    dtypes, and the HF tensors they hold are not expected (issue 10's packed modes)."""
    modules = dict(modules or {})
    untied_head = "logits_head" in modules and not cfg.tie_word_embeddings
    expected = {n: s for n, s in hf_tensor_shapes(cfg).items()
                if param_target(cfg, n)[0].rpartition(".")[0] not in modules
                and not (untied_head and n == "lm_head.weight")}
    with torch.device("meta"):
        model = CausalLM(cfg, rows)
    for path in modules:
        if path != "logits_head":
            # NOTE: a placeholder, so that nothing dense is allocated for what is replaced
            model.set_submodule(path, nn.Identity())
    if untied_head:
        model.lm_head = None
    model = _materialize(model, torch.device(device)).to(torch_dtype(dtype))
    for path, module in modules.items():
        # NOTE: inserted after the dtype cast: packed buffers keep their own dtypes
        if path == "logits_head":
            model.logits_head = module.to(device)
        else:
            model.set_submodule(path, module.to(device))
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in expected or name in seen:
                raise ValueError(f"unexpected or repeated tensor {name!r}")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {expected[name]}")
            target, part = param_target(cfg, name)
            dst = params[target] if part is None else params[target][part]
            dst.copy_(tensor)
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"no tensor given for {missing[:5]} ...")
    model.eval()
    return model


def _materialize(model: CausalLM, device: torch.device) -> CausalLM:
    """``model.to_empty(device)`` through plain factories: every meta parameter and buffer
    becomes an uninitialised tensor of its shape and dtype (shared ones stay shared).

    NOTE: ``to_empty`` calls ``empty_like`` on meta tensors, which runs torch's Python
    reference and imports sympy and ``torch.fx`` symbolic shapes: 1-2 s of every load."""
    made: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(fresh(p), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = fresh(b)
    return model


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of an HF folder, in a stable order (shard names sorted)."""
    return sorted(set(_tensor_files(Path(model_dir)).values()))

