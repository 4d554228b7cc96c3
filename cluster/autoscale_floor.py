"""The slow loop's simulator floor, the router's side (config `autoscale.floor: simulator`):
`floor_request` builds what planning.floor reads (the window's fit itself comes from
autoscale_window), and `run_floor` runs it in a process of its own.

Why a process: planning sits above cluster in the package layers, and the router's process
never imports the simulator (its engine types); a process also keeps the simulation's CPU off
the router's event loop, which only awaits its answer. Nothing here imports planning.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path


class FloorFailed(Exception):
    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome  # error | timeout


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
