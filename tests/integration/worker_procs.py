"""A child process hosting one prefill or decode worker for the two-process tests.

Control runs over JSON lines (test harness only): the parent writes commands on stdin, the
child answers each with a `reply` line and, between commands, steps its worker and writes
`first_token` (prefill), `admission` and `output` (decode) events on stdout. Destination
descriptors travel as base64 protobuf bytes, as a router would carry them.
Run: python -m tests.integration.worker_procs
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import queue
import sys
import threading
import time


def _params(d: dict):
    from engine.sampling_params import SamplingParams

    return SamplingParams(**d)


class Host:
    def __init__(self, out) -> None:
        self.out = out
        self.worker = None
        self.role = None

    def emit(self, **msg) -> None:
        print(json.dumps(msg), file=self.out, flush=True)

    # ---- commands -------------------------------------------------------------------------
    def cmd_init(self, role, model, transport, engine, deadline_s=10.0, policy="fail", local_threshold=0,
                 layer_delay_s=0.0):
        from kv_transfer.config import TransferConfig

        if self.worker is not None:
            self.worker.close()
        cfg = TransferConfig(deadline_s=deadline_s)
        self.role = role
        if role == "prefill":
            from prefill_worker import PrefillWorker

            self.worker = PrefillWorker(model, transport=transport, transfer_config=cfg, **engine)
            if layer_delay_s:  # fault injection: a slow sender
                sender = self.worker.connector.sender
                send = sender.send_layer

                def slow_send(rid, layer):
                    send(rid, layer)
                    time.sleep(layer_delay_s)

                sender.send_layer = slow_send
            return {}
        from decode_worker import DecodeConfig, DecodeWorker, TransferFailurePolicy

        conf = DecodeConfig(local_prefill_threshold=local_threshold, on_transfer_failure=TransferFailurePolicy(policy))
        self.worker = DecodeWorker(model, transport=transport, transfer_config=cfg, config=conf, **engine)
        return {"endpoint": self.worker.endpoint}

    def cmd_submit(self, request_id, prompt, params, descriptors):
        from prefill_worker import PrefillTask

        self.worker.submit(PrefillTask(request_id, prompt, _params(params), [base64.b64decode(d) for d in descriptors]))
        return {}

    def cmd_admit(self, request_id, prompt, params):
        adm = self.worker.admit(request_id, prompt, _params(params))
        return {"stage": adm.stage.name, "descriptors": [_b64(d) for d in adm.descriptors or []]}

    def cmd_cancel(self, request_id):
        return {"known": self.worker.cancel(request_id)}

    def cmd_stage(self, request_id):
        stage = self.worker.stage(request_id)
        status = self.worker.connector.receiver.status(request_id)
        return {"stage": stage.name if stage else None, "transfer": status.state.name if status else None}

    def cmd_load(self):
        load = dataclasses.asdict(self.worker.load())
        w = self.worker
        settled = not w.has_requests if self.role == "decode" else not (w.has_work or w.num_transferring)
        return {"load": load, "settled": settled,
                "computed_prompt_tokens": self.worker.core.num_computed_prompt_tokens}

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> None:
        if self.worker is None or not self.worker.has_work:
            return
        if self.role == "prefill":
            for r in self.worker.step():
                self.emit(event="first_token", request_id=r.request_id, token=r.first_token, ok=r.ok, error=r.error)
            return
        for o in self.worker.step():
            if not hasattr(o, "new_token_ids"):  # an Admission: a queued request got its pages
                self.emit(event="admission", request_id=o.request_id, descriptors=[_b64(d) for d in o.descriptors])
                continue
            self.emit(event="output", request_id=o.request_id, new=o.new_token_ids, source=o.source.value,
                      finished=o.finished, reason=o.finish_reason, error=o.error)


def _b64(desc: bytes | None) -> str | None:
    return None if desc is None else base64.b64encode(desc).decode()


def main() -> int:
    import logging

    import torch

    torch.set_num_threads(1)
    out = os.fdopen(os.dup(1), "w")  # replies on the real stdout; library chatter goes to stderr
    os.dup2(2, 1)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            inbox.put(json.loads(line))
        inbox.put(None)

    threading.Thread(target=read, daemon=True).start()
    host = Host(out)
    host.emit(event="ready")
    while True:
        busy = host.worker is not None and host.worker.has_work
        try:
            msg = inbox.get_nowait() if busy else inbox.get(timeout=0.005)
        except queue.Empty:
            msg = ...
        if msg is None:
            break
        if msg is not ...:
            mid = msg.pop("id")
            try:
                reply = getattr(host, "cmd_" + msg.pop("cmd"))(**msg)
                host.emit(event="reply", id=mid, ok=True, **reply)
            except Exception as exc:
                host.emit(event="reply", id=mid, ok=False, error=f"{type(exc).__name__}: {exc}")
            continue
        host.step()
    if host.worker is not None:
        host.worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


class WorkerProc:
    """The parent's handle on one child: call() waits for the reply; events go to `events`
    (a queue shared by both children, items are (name, event dict))."""

    def __init__(self, name: str, events: queue.Queue, timeout: float = 60.0) -> None:
        import subprocess
        import tempfile
        from pathlib import Path

        root = Path(__file__).resolve().parents[2]
        self.name, self.events = name, events
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.worker_procs"], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
        self._replies: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._next = 0
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{name} did not start within {timeout}s: {self.log()[-2000:]}")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            kind = msg.pop("event")
            if kind == "ready":
                self._ready.set()
            elif kind == "reply":
                with self._cond:
                    self._replies[msg.pop("id")] = msg
                    self._cond.notify_all()
            else:
                self.events.put((self.name, kind, msg))
        with self._cond:
            self._cond.notify_all()

    def call(self, cmd: str, timeout: float = 30.0, **kwargs) -> dict:
        with self._cond:
            mid = self._next
            self._next += 1
        self.proc.stdin.write(json.dumps({"cmd": cmd, "id": mid, **kwargs}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"{self.name} {cmd}: no reply; stderr: {self.log()[-3000:]}")
                self._cond.wait(min(left, 0.5))
            reply = self._replies.pop(mid)
        if not reply.pop("ok"):
            raise RuntimeError(f"{self.name} {cmd} failed: {reply['error']}")
        return reply

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except Exception:
                self.kill()
        self.stderr.close()
