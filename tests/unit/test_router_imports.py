"""The router's process stays small: importing every router module (and unpickling what the
workers send it) loads neither torch nor the model code. A fresh interpreter checks it, since
this test process has loaded torch long before."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "safetensors", "engine.core", "engine.model", "engine.model_runner",
         "engine.attention", "engine.scheduler", "engine.request", "kv_transfer", "prefill_worker.worker",
         "decode_worker.worker")

PROBE = """
import importlib, json, pickle, pkgutil, sys
import router
modules = sorted("router." + m.name for m in pkgutil.iter_modules(router.__path__))
for m in modules:
    importlib.import_module(m)
from decode_worker.types import Admission, DecodeOutput, DecodeStage, TokenSource
from engine.load import WorkerLoad
from engine.outputs import TokenLogprobs
from prefill_worker.types import PrefillResult
lp = TokenLogprobs(5, -0.1, 1, [(5, -0.1)])
for obj in (Admission("r", DecodeStage.WAITING_FOR_KV, [b"desc0", b"desc1"], 2, 4096), PrefillResult("r", 5, 9, first_logprobs=lp),
            DecodeOutput("r", [5], [5], TokenSource.DECODE_WORKER, DecodeStage.DECODING, new_logprobs=[lp]),
            WorkerLoad(free_pages=3, total_pages=4)):
    assert pickle.loads(pickle.dumps(obj)) == obj
heavy = json.loads(sys.argv[1])
print(json.dumps({"modules": modules,
                  "loaded": sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))}))
"""


def test_importing_every_router_module_leaves_torch_and_the_model_out():
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"router.dispatch", "router.frontend", "router.handles", "router.service", "router.server",
            "router.tokenizer"} <= set(report["modules"])
    assert report["loaded"] == []
