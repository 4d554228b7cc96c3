"""`pdcluster serve` when a router's process is killed (kill -9): it prints the loss and the
return (pid, seconds) and the router serves again on its port, the other router answering
meanwhile; `--request-log` writes one JSON line per request; with router.max_restarts 0 serve
exits 1 naming the router and the reason."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml

from tests.helpers import our_ray_processes, wait_until

pytestmark = pytest.mark.slow  # two more cluster starts (~30 s each here)

EXE = [sys.executable, "-m", "cluster.cli"]


class Serve:
    """`pdcluster serve` in its own session, its output read line by line as it comes."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(EXE + ["serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, pattern: str) -> re.Match | None:
        return next((m for m in (re.search(pattern, x) for x in list(self.lines)) if m), None)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        def seen():
            m = self.said(pattern)
            assert m or self.proc.poll() is None, "\n".join(self.lines)
            return m
        return wait_until(seen, timeout_s, 0.1, f"serve printing {pattern!r}; it printed:\n" + "\n".join(self.lines))

    def end(self) -> None:
        """Stop serve if it still runs (a failed test); every process of its session must end."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(10)

        def left() -> list[str]:
            return subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        try:  # Ray's processes exit once their gcs is gone: a moment, not at once
            wait_until(lambda: not left(), 30, 0.2, "the serve session's processes ending")
        finally:
            stray = left()
            for pid in stray:  # ours: they are in the session of the serve we started
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert not stray, f"processes left in the serve session: {stray}"


def _listener(port: int) -> int:
    """The pid listening on 127.0.0.1:port (the router's process)."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    raise AssertionError(f"nothing listens on port {port}")


def _generate(addr: str) -> list[str]:
    gen = subprocess.run(EXE + ["generate", "--address", addr, "hello", "--max-tokens", "5", "--temperature", "0",
                                "--show-ids"], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    return [line for line in gen.stdout.splitlines() if line.startswith("ids: [")]


def test_serve_brings_a_killed_router_back_and_logs_requests(tmp_path, tiny_model):
    tiny_model("llama")
    log_path = tmp_path / "requests.jsonl"
    serve = Serve(["--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1", "--routers", "2",
                   "--request-log", str(log_path)])
    try:
        routers = [serve.wait_for(rf"serving pdcluster.v1.Inference on (\S+) \(router-{i}\)", 240).group(1)
                   for i in range(2)]
        ids = _generate(routers[0])
        assert ids and _generate(routers[1]) == ids
        st = subprocess.run(EXE + ["status", "--address", routers[1]], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "decode-0" in st.stdout, st.stdout + st.stderr
        pid = _listener(int(routers[0].rsplit(":", 1)[1]))
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        serve.wait_for(rf"router-0 lost \(pid {pid}\)", 30)
        assert _generate(routers[1]) == ids  # the other router serves while router-0 is out
        back = serve.wait_for(rf"router-0 back: serving on {re.escape(routers[0])} again \(pid (\d+)\), "
                              rf"([\d.]+) s after", 60)
        print(f"\nserve: router-0 killed -> back line after {time.monotonic() - killed:.1f} s ({back.group(0)})")
        assert int(back.group(1)) not in (0, pid)
        assert _generate(routers[0]) == ids
        lines = [json.loads(x) for x in log_path.read_text().splitlines()]
        assert len(lines) == 4, lines  # the 4 generates; nothing of the warm-ups
        assert [x["router"] for x in lines] == ["router-0", "router-1", "router-1", "router-0"]
        assert all(x["finish_reason"] == "length" and x["completion_tokens"] == 5 and x["request_id"]
                   and x["decode_worker"] == "decode-0" for x in lines), lines
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(90) == 0, "\n".join(serve.lines)
        assert "stopped" in serve.lines
    finally:
        serve.end()
    assert not our_ray_processes()


def test_serve_exits_non_zero_when_a_router_cannot_come_back(tmp_path, tiny_model):
    tiny_model("llama")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump({"model": "tiny", "router": {"port": 0, "max_restarts": 0},
                                   "pools": [{"name": "prefill", "role": "prefill"},
                                             {"name": "decode", "role": "decode"}]}))
    serve = Serve(["--config", str(cfg), "--http-port", "-1", "--metrics-port", "-1"])
    try:
        addr = serve.wait_for(r"serving pdcluster.v1.Inference on (\S+)", 240).group(1)
        pid = _listener(int(addr.rsplit(":", 1)[1]))
        os.kill(pid, signal.SIGKILL)
        assert serve.proc.wait(90) == 1, "\n".join(serve.lines)
        serve._reader.join(10)
        said = "\n".join(serve.lines)
        assert re.search(r"pdcluster serve: router-0 \(last on \S+\) cannot come back: .*max_restarts 0", said), said
        assert "stopped" in serve.lines
    finally:
        serve.end()
