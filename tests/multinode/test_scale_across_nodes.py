"""Scaling a pool across hosts at run time (the Scale RPC, `pdcluster scale`): the decode pool
goes 1 -> 2 with its new worker on another machine, then back 2 -> 1, under open greedy streams.

The cluster is served as in the rest of the suite (decode pool pinned by `node_decode`, one unit
on the decode host, taken by the pool's first worker). Scale 1 -> 2 first: no host has room for
the new worker, so its placement group stays PENDING in Ray (asked of Ray, not guessed) and the
worker `starting`. Then a fourth host joins (`decode2`, 10.77.0.4: a new namespace on the bridge,
`ray start` with one CPU and one unit of `node_decode`), as a machine added to a running cluster
would: Ray places the waiting group there and the scale-out goes on, with no second Scale call.
ClusterStatus must show the new worker there (its node's address, its process in that
namespace), serving and placed on.

Throughout, a client in the head's namespace keeps STREAMS greedy streams open (a slot starts its
next stream as soon as one ends): no stream fails and every one's tokens equal Hugging Face
greedy. Scale-in drains the least loaded decode worker (either one) while the streams run: its
streams finish within the drain grace, its pages come free, its process is gone from its host;
every page is free on the workers left. The times (Scale -> the new worker serving on the joined
host; Scale -> the victim stopped, and the drain as serve logs it) are printed, never asserted.
Synchronized on ClusterStatus (polled in the head's namespace), never on sleeps; the joined host
leaves (its namespace deleted, Ray sees its node dead) after each transport's cluster stops."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import hf_greedy, random_prompts, wait_until

from .conftest import CLIENT, VENV_BIN, Served

pytestmark = pytest.mark.multinode

POOL = "decode"
NEW_HOST = "decode2"
STREAMS = 12
LENGTHS = (3, 9, 16, 17, 24, 33, 45, 60, 5, 31, 12, 48)
# a different length per prompt, so that streams end (and new ones start) at different times and
# every decode worker holds some at any moment; prompt + tokens within the suite's max_model_len (256)
MAX_TOKENS = [40 + 13 * i for i in range(len(LENGTHS))]
DEADLINE_S = 300  # a worker built, warmed up and serving on a loaded 2-core machine


@pytest.fixture(scope="module")
def reference(tiny_model):
    path = Path(tiny_model("llama"))
    prompts = random_prompts(LENGTHS, json.loads((path / "config.json").read_text())["vocab_size"], seed=21)
    return prompts, [ids[:n] for ids, n in zip(hf_greedy(path, prompts, max(MAX_TOKENS)), MAX_TOKENS)]


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def scaled(request, netns, tmp_path_factory):
    """The cluster serving; the test joins the second decode host, which leaves after the cluster stops."""
    s = Served(netns, request.param, tmp_path_factory.mktemp(f"serve-scale-{request.param}"))
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()
        if any(h.name == NEW_HOST for h in netns.hosts):
            netns.remove_host(NEW_HOST)


class Watch:
    """ClusterStatus polled in the head's namespace (`_client.py watch`), every answer kept, so a
    transition is seen even when it lasts less than the test's own polling."""

    def __init__(self, served: Served, path: Path) -> None:
        self.path, self.seen, self._pos = path, [], 0
        self._out = open(path, "w")
        self.proc = served.netns.popen("head", [str(VENV_BIN / "python"), str(CLIENT), served.address, "watch",
                                                "0.2"], stdout=self._out, stderr=subprocess.STDOUT, text=True)

    def _read(self) -> list[dict]:
        with open(self.path) as f:
            f.seek(self._pos)
            chunk = f.read()
        whole = chunk[:chunk.rfind("\n") + 1]
        self._pos += len(whole.encode())
        new = [json.loads(ln) for ln in whole.splitlines() if ln.startswith("{")]
        self.seen += new
        return new

    def until(self, pred, what: str, timeout_s: float = DEADLINE_S) -> dict:
        """The first answer (from now on) for which pred holds."""
        def check():
            if self.proc.poll() is not None:
                raise AssertionError(f"the status watcher exited:\n{self.path.read_text()[-2000:]}")
            return next((ln for ln in self._read() if "workers" in ln and pred(ln)), None)
        return wait_until(check, timeout_s, 0.1, what)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(30)
        self._out.close()


class Load:
    """STREAMS greedy streams kept open (`_client.py load`) until `finish`."""

    def __init__(self, served: Served, prompts, path: Path) -> None:
        self.stop_file, self.err = path.with_suffix(".stop"), path.with_suffix(".err")
        with open(self.err, "w") as err:
            self.proc = served.netns.popen("head", [str(VENV_BIN / "python"), str(CLIENT), served.address, "load",
                                                    json.dumps(prompts), json.dumps(MAX_TOKENS), str(STREAMS),
                                                    str(self.stop_file)],
                                           stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline().strip()
        assert line == "STARTED", f"streams did not start ({line!r}): {self.err.read_text()[-2000:]}"

    def finish(self) -> list[dict]:
        self.stop_file.touch()
        out = self.proc.stdout.readline()
        assert self.proc.wait(120) == 0, self.err.read_text()[-2000:]
        return json.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(30)


def _w(line: dict, wid: str) -> dict | None:
    return next((w for w in line["workers"] if w["worker_id"] == wid), None)


def _pool(line: dict) -> dict:
    return next(p for p in line["pools"] if p["name"] == POOL)


def _placement_group_state(netns, name: str) -> str:
    """Ray's state of the placement group `name` (PENDING while no node has room for it), asked
    from the head's namespace."""
    code = ("import json, ray; from ray.util import placement_group_table; ray.init(log_to_driver=False); "
            "print('PG ' + json.dumps([g['state'] for g in placement_group_table().values() "
            f"if g['name'] == {name!r}]))")
    r = netns.run("head", [str(VENV_BIN / "python"), "-c", code], env={"RAY_ADDRESS": netns.head_address}, timeout=120)
    states = json.loads(next(ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("PG "))[3:])
    return states[-1] if states else ""


def _check_streams(out: list[dict], ref: list[list[int]], what: str) -> None:
    failed = [o for o in out if o["error"]]
    assert not failed, f"{what}: {len(failed)} of {len(out)} streams failed: {failed[:3]}"
    wrong = [o["prompt"] for o in out if o["ids"] != ref[o["prompt"]]]
    assert not wrong, f"{what}: streams of prompts {wrong} differ from Hugging Face greedy"


def test_scale_decode_pool_onto_a_joined_host_and_back(scaled, reference, tmp_path):
    netns = scaled.netns
    prompts, ref = reference
    decode_ip = netns.host("decode").ip
    watch = Watch(scaled, tmp_path / "status.jsonl")
    load = None
    try:
        first = watch.until(lambda ln: _pool(ln)["target"] == _pool(ln)["current"] == 1, "the decode pool at 1")
        old = next(w for w in first["workers"] if w["pool"] == POOL)
        assert old["state"] == "serving" and old["node"] == decode_ip, old

        # ---- scale-out under open streams: no room for the new worker until a host joins
        load = Load(scaled, prompts, tmp_path / "load-out")
        resp = scaled.client("scale", POOL, "2")
        assert (resp["previous_target"], resp["target"], resp["current"]) == (1, 2, 1), resp
        t_out = resp["t"]

        def others(ln):
            return [w for w in ln["workers"] if w["pool"] == POOL and w["worker_id"] != old["worker_id"]]
        new_id = others(watch.until(others, "the new decode worker in ClusterStatus"))[0]["worker_id"]
        # no room anywhere: its placement group waits in Ray, the worker is starting, the pool at 1
        wait_until(lambda: _placement_group_state(netns, f"pdcluster-{new_id}") == "PENDING", 120, 0.5,
                   f"the placement group of {new_id} pending in Ray")
        watch.until(lambda ln: True, "a status")
        line = watch.seen[-1]
        assert _w(line, new_id)["state"] == "starting" and _pool(line)["current"] == 1, line
        t_join = time.time()
        new_ip = netns.add_host(NEW_HOST, {"node_decode": 1}, num_cpus=1).ip   # a machine joins
        t_joined = time.time()
        host_of = {h.ip: h.name for h in netns.hosts}
        serving = watch.until(lambda ln: (w := _w(ln, new_id)) and w["state"] == "serving" and w["healthy"]
                              and w["pid"] and _pool(ln)["current"] == 2, f"{new_id} serving")
        t_serving = serving["t"]
        new = _w(serving, new_id)
        assert new["node"] == new_ip, f"{new_id} runs on {new['node']}, not the joined host {new_ip}: {new}"
        assert new["pid"] in netns.pids(NEW_HOST), f"{new_id}'s process {new['pid']} is not in {NEW_HOST}'s namespace"
        assert old["pid"] in netns.pids("decode"), "the first decode worker left its host"
        placed = watch.until(lambda ln: _w(ln, new_id)["requests_placed"] > 0, f"requests placed on {new_id}", 120)
        t_placed = placed["t"]
        out1 = load.finish()
        load = None
        _check_streams(out1, ref, "scale-out")
        on_new = sum(o["decode_worker"] == new_id for o in out1)
        assert on_new > 0, f"no stream decoded on {new_id}: {[o['decode_worker'] for o in out1]}"

        # ---- scale-in under open streams, both decode workers holding some
        load = Load(scaled, prompts, tmp_path / "load-in")
        watch.until(lambda ln: all(_w(ln, i)["running_requests"] > 0 for i in (old["worker_id"], new_id)),
                    "streams running on both decode workers", 120)
        resp = scaled.client("scale", POOL, "1")
        assert (resp["previous_target"], resp["target"]) == (2, 1), resp
        t_in = resp["t"]

        def leaving(ln):
            return [w for w in ln["workers"] if w["pool"] == POOL and w["state"] in ("draining", "stopped")]
        victim = leaving(watch.until(leaving, "a decode worker draining", 120))[0]["worker_id"]
        last_seen = next(w for ln in reversed(watch.seen) for w in ln["workers"]
                         if w["worker_id"] == victim and w["pid"])
        stopped = watch.until(lambda ln: (w := _w(ln, victim)) is not None and w["state"] == "stopped",
                              f"{victim} stopped", 120)
        t_stopped = stopped["t"]
        out2 = load.finish()
        load = None
        _check_streams(out2, ref, "scale-in")
        survivor = new_id if victim == old["worker_id"] else old["worker_id"]
        assert all(o["decode_worker"] == survivor or o["migrations"] == 0 for o in out2), out2
        # every page free on the workers left; the pool at 1 with no failed start; nothing failed
        final = watch.until(lambda ln: all(w["total_pages"] and w["free_pages"] == w["total_pages"]
                                           for w in ln["workers"] if w["state"] != "stopped"),
                            "every page free on every remaining worker", 60)
        p = _pool(final)
        assert (p["target"], p["current"], p["start_failures"]) == (1, 1, 0), p
        assert [w["worker_id"] for w in final["workers"] if w["pool"] == POOL and w["state"] != "stopped"] == \
            [survivor], final["workers"]
        assert final["requests_failed"] == 0, final
        # the victim's process is gone from its host
        vhost, vpid = host_of[last_seen["node"]], last_seen["pid"]
        wait_until(lambda: vpid not in netns.pids(vhost) and not Path(f"/proc/{vpid}").exists(), 60, 0.1,
                   f"{victim}'s process {vpid} gone from {vhost}")

        log = scaled.log.read_text()
        up = re.search(rf"worker {new_id} serving, ([\d.]+) s after the scale-out began \(built and ready in "
                       rf"([\d.]+) s, warm-up ([\d.]+) s\)", log)
        down = re.search(rf"worker {victim} removed: drained in ([\d.]+) s \((\d+) request\(s\) finished on it, "
                         rf"(\d+) moved\)", log)
        assert up and down, log[-3000:]
        # the victim had streams open when it began draining: they finished on it or moved
        assert int(down.group(2)) + int(down.group(3)) >= 1, down.group(0)
        moved = sum(o["migrations"] for o in out2)
        print(f"\nscale across hosts over {scaled.transport}: {POOL} 1 -> 2, {new_id} pending until {NEW_HOST} "
              f"({new_ip}) joined (Scale +{t_join - t_out:.1f} s; its `ray start` took {t_joined - t_join:.1f} s): "
              f"serving there {t_serving - t_joined:.1f} s after it joined, {t_serving - t_out:.1f} s after Scale "
              f"(serve: {up.group(1)} s after the scale-out began, built and ready {up.group(2)} s, warm-up "
              f"{up.group(3)} s), first placement on it at +{t_placed - t_out:.1f} s; "
              f"{len(out1)} streams, {on_new} decoded on {new_id}, 0 failed, tokens = HF greedy. "
              f"2 -> 1: victim {victim} on {vhost}, stopped {t_stopped - t_in:.1f} s after Scale (serve: drained "
              f"in {down.group(1)} s, {down.group(2)} finished on it, {down.group(3)} moved; streams' migrations "
              f"{moved}); {len(out2)} streams, 0 failed, tokens = HF greedy; every page free; process gone")
    finally:
        if load is not None:
            load.kill()
        watch.close()
