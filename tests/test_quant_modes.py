"""Serving modes, ``--quant`` (issue 10; SPEC T4, P1, O1): every mode loads or fails with a
typed error, ``auto`` picks a batch-invariant mode where one applies, the packed ``q4`` mode is
the file's model up to bfloat16 rounding (q/k row order, biases and q/k norms included), and a
different mode is a different ``model_snapshot``. Tiny GGUF files from ``test_gguf_tiny``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from coda.cli import app
from coda.commands.loading import load_engine as _load
from coda.engine.types import EngineConfig
from coda.models import modes
from coda.models.config import ModelLoadError, UnsupportedModelError
from coda.models.gguf_file import GGUFCheckpoint, open_gguf
from coda.models.gguf_packed import build_q4
from coda.models.gguf_weights import load_gguf_model
from coda.models.modes import AUTO_ORDER, MODE_NAMES, QUANT_MODES, resolve_mode
from coda.models.quant import Int4Linear, Q8Split
from coda.models.source import ModelSource, open_model, resolve_model
from coda.server.logs import JsonFormatter
from tests.test_gguf_tiny import PROMPT, write_gguf
from tests.test_models import full_forward

PAD = 11  # NOTE: 101 + 11 = 112 tokens, a multiple of 16 (the int4 kernel's N)

# NOTE: what auto picks for a Q4_1 file on this machine: the first available mode of AUTO_ORDER
# (``packed`` where Coda's kernel builds, else torch's int4 ``q4``)
_AUTO = next(n for n in AUTO_ORDER if QUANT_MODES[n].available() is None)


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("q4") / "tiny-q4.gguf", "llama", qtype="Q4_1",
                      extra_tokens=PAD)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("f32") / "tiny-f32.gguf", "llama",
                      extra_tokens=PAD)


@pytest.mark.parametrize(("arch", "name"), [("llama", "tiny mistral"), ("qwen2", "tiny"),
                                            ("qwen3", "tiny")])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_is_the_files_model_up_to_bf16(tmp_path: Path, arch: str, name: str,
                                          qtype: str) -> None:
    """The packed model's logits are within 5% of max |logit| of the exact fp32 mode's (bf16
    scales and matmul inputs; measured 1-3%); a projection left with llama.cpp's q/k row order
    is off by ~96%. Every projection is Int4Linear and the Q4 head Int4Linear too."""
    ckpt = open_gguf(write_gguf(tmp_path / "m.gguf", arch, name=name, qtype=qtype,
                                extra_tokens=PAD))
    exact = full_forward(load_gguf_model(ckpt), PROMPT)
    packed_model = build_q4(ckpt)
    packed = full_forward(packed_model, PROMPT)
    assert (packed - exact).abs().max() <= 0.05 * exact.abs().max()
    layer = packed_model.model.layers[0]
    kinds = {type(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                               layer.mlp.gate_up_proj, layer.mlp.down_proj,
                               packed_model.logits_head)}
    assert kinds == {Int4Linear}
    assert packed_model.lm_head is None  # NOTE: no dense copy of the untied head is kept
    if arch == "qwen2":
        assert layer.self_attn.qkv_proj.bias is not None


def test_q4_refuses_q8_0_projections(tmp_path: Path) -> None:
    """A file whose projections are Q8_0 is not a q4 file: auto serves it with Coda's block
    kernel (``packed`` takes Q8_0) where that builds, else fp32."""
    ckpt = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", qtype="Q8_0", extra_tokens=PAD))
    assert "is Q8_0" in (modes.QUANT_MODES["q4"].applies(ckpt) or "")  # projections are Q8_0
    packed = modes.QUANT_MODES["packed"]
    assert packed.applies(ckpt) is None
    want = "packed" if packed.available() is None else "fp32"
    assert resolve_mode("auto", None, ckpt).name == want


def _sources(q4_file: Path, f32_file: Path, hf_dir: Path) -> dict[str, tuple[ModelSource,
                                                                          GGUFCheckpoint | None]]:
    return {"q4-gguf": (resolve_model(q4_file), open_gguf(q4_file)),
            "f32-gguf": (resolve_model(f32_file), open_gguf(f32_file)),
            "hf": (resolve_model(hf_dir), None)}


def test_resolve_mode_exhaustively_follows_the_rules(q4_file: Path, f32_file: Path,
                                                     server_checkpoint: Path) -> None:
    """For every (--quant, --dtype, source) — junk included — the result is a typed error or
    a mode that: is the one asked for (or auto's pick), serves HF folders only if dense,
    applies to the file, runs the explicit dtype; auto without dtype on a file q4 applies to
    is batch-invariant (T4), elsewhere (an HF folder, a float GGUF) fp32-kernel, the invariant
    dense mode (issue 18 item 2), or fp32 where the native module is missing."""
    sources = _sources(q4_file, f32_file, server_checkpoint)
    for quant, dtype, (kind, (_, ckpt)) in itertools.product(
            (*MODE_NAMES, "int3", ""), (None, "float32", "bfloat16", "float16", "float64"),
            sources.items()):
        try:
            mode = resolve_mode(quant, dtype, ckpt)
        except ModelLoadError as exc:
            assert str(exc) and "\n" not in str(exc)
            legal = quant in MODE_NAMES and dtype in (None, *modes.DENSE_BY_DTYPE)
            if legal and quant != "auto":
                asked = QUANT_MODES[quant]
                assert (dtype is not None and asked.dtype != dtype) or (
                    ckpt is None and not asked.dense) or (
                    ckpt is not None and asked.applies(ckpt) is not None), (quant, dtype, kind)
            else:
                assert not legal, (quant, dtype, kind)
            continue
        assert quant in ("auto", mode.name)
        assert mode.dense or ckpt is not None
        assert ckpt is None or mode.applies(ckpt) is None
        assert dtype is None or mode.dtype == dtype
        if quant == "auto" and dtype is None:
            dense = "fp32-kernel" if QUANT_MODES["fp32-kernel"].available() is None else "fp32"
            assert mode.name == (_AUTO if kind == "q4-gguf" else dense), kind
            assert mode.batch_invariant == (mode.name != "fp32")  # NOTE: fp32 only as fallback


def test_auto_order_lists_only_batch_invariant_modes_and_skips_unavailable(
        q4_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T4: auto never picks a mode that is not batch-invariant; a mode this machine cannot run
    is skipped by auto and refused, typed, when asked for."""
    assert AUTO_ORDER and all(QUANT_MODES[n].batch_invariant for n in AUTO_ORDER)
    ckpt = open_gguf(q4_file)
    for name in AUTO_ORDER:
        monkeypatch.setitem(QUANT_MODES, name, dataclasses.replace(
            QUANT_MODES[name], available=lambda: "no such kernel here"))
    assert resolve_mode("auto", None, ckpt).name == "fp32"
    with pytest.raises(UnsupportedModelError, match="not available on this machine: no such"):
        resolve_mode(AUTO_ORDER[0], None, ckpt)


@pytest.mark.parametrize("quant", list(QUANT_MODES))
def test_each_mode_loads_or_fails_typed(quant: str, q4_file: Path, f32_file: Path,
                                        server_checkpoint: Path) -> None:
    """Dense modes load every source; q4 modes load the Q4 file and refuse the others with
    UnsupportedModelError naming why. A loaded model answers at its mode's dtype and carries
    the mode in its identity."""
    for kind, (src, _) in _sources(q4_file, f32_file, server_checkpoint).items():
        mode = QUANT_MODES[quant]
        if mode.dense or kind == "q4-gguf":
            loaded = open_model(src, quant=quant)
            assert loaded.mode is mode and loaded.identity.quant_mode == quant
            assert loaded.identity.dtype == mode.dtype == loaded.dtype
            logits = full_forward(loaded.model, [5, 6, 7])
            assert logits.shape[0] == 3 and torch.isfinite(logits).all()
        else:
            with pytest.raises(UnsupportedModelError,
                               match="needs a GGUF" if kind == "hf" else "is F32"):
                open_model(src, quant=quant)


def test_p1_identity_differs_per_mode(q4_file: Path) -> None:
    """P1: the same file served in another mode is another model_snapshot; the same mode
    twice is the same one."""
    src = resolve_model(q4_file)
    snaps = {q: open_model(src, quant=q).identity.snapshot for q in
             ("fp32", "bf16", "q4", "q4-int8head")}
    assert len(set(snaps.values())) == 4
    assert open_model(src).identity.snapshot == open_model(src, quant=_AUTO).identity.snapshot
    assert open_model(src, dtype="bfloat16").identity.snapshot == snaps["bf16"]


def test_q8_0_tied_head_runs_as_q8split_or_int8(tmp_path: Path) -> None:
    """SmolLM2's layout: Q4_1 projections, a tied Q8_0 embedding. q4 packs the head as the
    exact Q8Split (the embedding stays dense for lookups); q4-int8head requantizes it."""
    ckpt = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", qtype="Q4_1", extra_tokens=PAD,
                                tied_embd_qtype="Q8_0"))
    assert ckpt.config.tie_word_embeddings
    q4 = build_q4(ckpt)
    assert isinstance(q4.logits_head, Q8Split)
    exact = full_forward(load_gguf_model(ckpt), PROMPT)
    assert (full_forward(q4, PROMPT) - exact).abs().max() <= 0.05 * exact.abs().max()
    assert type(build_q4(ckpt, head="int8").logits_head).__name__ == "Int8Linear"


# ------------------------------------------------------------------------------------ the CLI
def test_cli_quant_that_does_not_apply_exits_2_with_one_line(server_checkpoint: Path,
                                                             f32_file: Path) -> None:
    runner = CliRunner()
    for args, needle in (((str(server_checkpoint), "q4"), "needs a GGUF file"),
                         ((str(f32_file), "q4-int8head"), "is F32"),
                         ((str(f32_file), "int3"), "unknown --quant 'int3'")):
        res = runner.invoke(app, ["generate", "hi", "--model", args[0], "--quant", args[1],
                                  "--max-tokens", "1"])
        assert res.exit_code == 2, res.output
        assert needle in res.output and "Traceback" not in res.output
        # NOTE: one error line, after the progress line saying what is being loaded
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 2 and lines[0].startswith("loading model"), lines
    res = runner.invoke(app, ["bench", "--model", str(server_checkpoint), "--quant", "q4"])
    assert res.exit_code == 2 and "needs a GGUF file" in res.output


def test_cli_models_lists_the_modes_auto_first(q4_file: Path, f32_file: Path) -> None:
    """``coda models``: what auto picks, then every other mode that loads the model here."""
    from coda.models.catalog import describe_source

    q4 = describe_source("q4", resolve_model(q4_file))
    f32 = describe_source("f32", resolve_model(f32_file))
    kernel = ("fp32-kernel",) if QUANT_MODES["fp32-kernel"].available() is None else ()
    assert (q4.quant_auto, q4.quant_modes) == (_AUTO, ("fp32", *kernel, "bf16", "fp16", "q4", "packed", "packed-q8", "q4-int8head"))
    assert (f32.quant_auto, f32.quant_modes) == ((*kernel, "fp32")[0], ("fp32", *kernel, "bf16", "fp16"))
    res = CliRunner().invoke(app, ["models", str(q4_file)], env={"COLUMNS": "300"})
    order = " ".join([_AUTO, *(m for m in q4.quant_modes if m != _AUTO)])
    assert res.exit_code == 0 and order in " ".join(res.output.split()), res.output


def test_o1_serve_logs_one_json_load_line_with_the_mode(q4_file: Path) -> None:
    """O1: ``coda serve`` logs one JSON line naming the serving mode, its numerics, whether it
    is batch-invariant, and the snapshot that includes the mode."""
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("coda.test.load")
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        engine = _load(str(q4_file), EngineConfig(num_blocks=8), logger.info)
    finally:
        logger.removeHandler(handler)
    summary: dict[str, Any] = json.loads(JsonFormatter().format(
        next(r for r in records if r.getMessage() == "model loaded")))
    assert summary["quant_mode"] == _AUTO and summary["batch_invariant"] is True
    assert summary["numerics"] == QUANT_MODES[_AUTO].numerics
    assert summary["model_snapshot"] == engine.model_snapshot
    assert any(r.getMessage().startswith(f"serving mode (--quant): {_AUTO}") for r in records)
