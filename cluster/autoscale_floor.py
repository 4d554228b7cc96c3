"""The slow loop's simulator floor, the router's side (config `autoscale.floor: simulator`):
`RequestSamples` keeps the prompt, output and cached tokens of each finished request (from the
router's request log lines) for the window's length spread and prefix-hit rate, `floor_request`
builds what planning.floor reads, and `run_floor` runs it in a process of its own.

Why a process: planning sits above cluster in the package layers, and the router's process
never imports the simulator (its engine types); a process also keeps the simulation's CPU off
the router's event loop, which only awaits its answer. Nothing here imports planning.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections import deque
from pathlib import Path

REQUEST_LOGGER = "pdcluster.requests"  # router.metrics.log_request: one JSON line per request


class FloorFailed(Exception):
    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome  # error | timeout


class RequestSamples(logging.Handler):
    """(time, prompt, output, cached tokens) of the router's finished requests, the latest `keep`."""

    def __init__(self, clock=time.monotonic, keep: int = 8192) -> None:
        super().__init__(logging.INFO)
        self.clock = clock
        self.samples: deque = deque(maxlen=keep)
        self._restore: tuple[int, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            d = json.loads(record.getMessage())
            if "error" not in d:
                self.samples.append((self.clock(), int(d["prompt_tokens"]), int(d["completion_tokens"]),
                                     int(d.get("cached_tokens", 0))))
        except (ValueError, KeyError, TypeError):
            pass

    def attach(self) -> None:
        """The request lines are made only when the logger is enabled for INFO: where they were not,
        enable it and stop them propagating, so that they still go nowhere else."""
        logger = logging.getLogger(REQUEST_LOGGER)
        if not logger.isEnabledFor(logging.INFO):
            self._restore = (logger.level, logger.propagate)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        logger.addHandler(self)

    def detach(self) -> None:
        logger = logging.getLogger(REQUEST_LOGGER)
        logger.removeHandler(self)
        if self._restore is not None:
            logger.setLevel(self._restore[0])
            logger.propagate = self._restore[1]
            self._restore = None

    def spread(self, now: float, span: float) -> dict:
        """Over the last `span` seconds: samples, the coefficient of variation (standard deviation
        / mean) of prompt and output lengths, and the prefix-cache hit rate (cached / prompt tokens)."""
        rows = [s for s in self.samples if now - s[0] <= span + 1e-6]
        out = {"samples": len(rows), "prompt_cv": None, "output_cv": None, "prefix_hit": None}
        if rows:
            prompt = sum(r[1] for r in rows)
            out["prefix_hit"] = round(min(1.0, sum(r[3] for r in rows) / prompt), 4) if prompt else 0.0
        if len(rows) >= 2:
            out["prompt_cv"] = round(_cv([r[1] for r in rows]), 4)
            out["output_cv"] = round(_cv([r[2] for r in rows]), 4)
        return out


def _cv(xs: list[int]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) / m if m > 0 else 0.0


def floor_request(config, targets: dict[str, int], pages: dict[str, int], window: dict, budget_s: float) -> dict:
    """What `python -m planning.floor` reads (planning.floor.FloorRequest): the cluster config with
    every pool at its target and, where its workers report them, their KV pages; the autoscaled
    pools' bounds; the profile; the window's fit; the SLO."""
    a = config.autoscale
    cfg = config.model_dump(mode="json", exclude={"autoscale"})
    for p in cfg["pools"]:
        p["replicas"] = max(1, targets.get(p["name"], p["replicas"]))
        if pages.get(p["name"]):
            p["engine"]["num_pages"] = pages[p["name"]]
    return {"config": cfg, "bounds": {n: [ap.min_replicas, ap.max_replicas] for n, ap in a.pools.items()},
            "profile": a.profile_json, "window": window,
            "slo": {"ttft_s": a.slo.ttft_s, "itl_s": a.slo.itl_s, "percentile": a.slo.percentile},
            "budget_s": budget_s}


async def run_floor(request: dict, timeout_s: float, nice: int = 10) -> dict:
    """planning.floor's answer to `request`, from `python -m planning.floor` (at `nice` above this
    process: the workers and the router come first); FloorFailed on a timeout (it is killed), a
    failed run or an answer that is not JSON."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the folder holding cluster/ and planning/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "planning.floor", "--nice", str(nice), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), timeout_s)
    except asyncio.TimeoutError:
        raise FloorFailed("timeout", f"no answer in {timeout_s:g} s (killed)") from None
    finally:
        if proc.returncode is None:  # timed out, or the planner stopped meanwhile
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.wait())
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if proc.returncode != 0 or "floors" not in answer:
        tail = answer.get("error") or err.decode(errors="replace").strip()[-300:] or "no answer"
        raise FloorFailed("error", f"exit {proc.returncode}: {tail}")
    return answer
