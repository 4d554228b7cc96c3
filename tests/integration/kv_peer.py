"""A child process hosting KV transfer receivers and senders for the two-process tests.

Driven by JSON lines on stdin (test control only; the transfer itself speaks protobuf),
one reply line per command on stdout. Run: python -m tests.integration.kv_peer
Pools are filled deterministically from a seed (make_pool), so the test process can
rebuild a sender's pool and compute what the receiver must hold.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import sys
import time

import numpy as np
import torch


def make_pool(spec: dict, layout: dict, num_pages: int, seed: int):
    from kv_transfer.layout import KVLayout, KVPool, ModelSpec, torch_dtype

    lay = KVLayout(**layout)
    pool = KVPool.allocate(ModelSpec(**spec), lay, num_pages)
    gen = torch.Generator().manual_seed(seed)
    for t in pool.layers:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(torch_dtype(lay.dtype)))
    return pool


def request_tokens(pool, pages: list[int], num_tokens: int) -> torch.Tensor:
    """Token-major view of a request's KV: [layers, 2, tokens, heads, head_dim]."""
    idx = torch.tensor(pages, dtype=torch.int64)
    lay = pool.layout
    return torch.stack([t.index_select(0, idx).transpose(0, 1).reshape(2, -1, lay.num_heads, lay.head_dim)[:, :num_tokens]
                        for t in pool.layers])


def digest(tokens: torch.Tensor) -> str:
    raw = tokens.contiguous().view(torch.uint8) if tokens.dtype != torch.uint8 else tokens
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


class Peer:
    def __init__(self) -> None:
        self.objects: dict[str, object] = {}
        self.released: dict[str, list[str]] = {}

    def _config(self, cfg: dict):
        from kv_transfer.config import TransferConfig

        return TransferConfig(**cfg)

    def cmd_receiver(self, name, transport, spec, layout, num_pages, seed=0, config=None):
        from kv_transfer.registry import create_receiver

        pool = make_pool(spec, layout, num_pages, seed)
        for t in pool.layers:
            t.zero_()
        self.released[name] = []
        self.objects[name] = create_receiver(transport, pool, self._config(config or {}),
                                             on_release=lambda rid, pages: self.released[name].append(rid))
        return {"endpoint": self.objects[name].endpoint}

    def cmd_sender(self, name, transport, spec, layout, num_pages, seed, config=None):
        from kv_transfer.registry import create_sender

        pool = make_pool(spec, layout, num_pages, seed)
        self.released[name] = []
        self.objects[name] = create_sender(transport, pool, self._config(config or {}),
                                           on_release=lambda rid, pages, st: self.released[name].append(rid))
        return {}

    def cmd_expect(self, name, request_id, page_ids, num_tokens, deadline_s=None):
        desc = self.objects[name].expect(request_id, page_ids, num_tokens, deadline_s)
        return {"descriptor": base64.b64encode(desc.to_bytes()).decode()}

    def cmd_start(self, name, request_id, descriptors, src_pages, num_tokens):
        from kv_transfer.descriptor import DestinationDescriptor

        dests = [DestinationDescriptor.from_bytes(base64.b64decode(d)) for d in descriptors]
        status = self.objects[name].start(request_id, dests, src_pages, num_tokens)
        return {"state": status.state.name, "error": status.error}

    def cmd_send(self, name, request_id, layers, delay_s=0.0, first_token=None, prompt_len=0, final_delay_s=0.0):
        sender = self.objects[name]
        for layer in layers:
            if delay_s:
                time.sleep(delay_s)
            sender.send_layer(request_id, layer)
        if first_token is not None:
            time.sleep(final_delay_s)
            sender.finish(request_id, first_token, prompt_len)
        return {}

    def cmd_wait(self, name, request_id, wait_s, pages=None):
        t0 = time.monotonic()
        status = self.objects[name].wait(request_id, wait_s)
        reply = {"state": status.state.name, "error": status.error, "first_token": status.first_token,  # noqa: E501
                 "waited_s": time.monotonic() - t0}
        if pages is not None:
            inc = self.objects[name].book.get(request_id)
            num_tokens = inc.num_tokens if inc is not None else 0
            if num_tokens:
                reply["digest"] = digest(request_tokens(self.objects[name].pool, pages, num_tokens))
        return reply

    def cmd_take(self, name, request_id):
        self.objects[name].take(request_id)
        return {}

    def cmd_state(self, name):
        obj = self.objects[name]
        return {"tracked": obj.tracked_pages(), "released": self.released[name]}

    def cmd_close(self, name):
        self.objects.pop(name).close()
        return {}


def main() -> int:
    import os

    # replies go to the original stdout; anything libraries print (NIXL logs) goes to stderr
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    peer = Peer()
    print(json.dumps({"ok": True, "ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            reply = getattr(peer, "cmd_" + msg.pop("cmd"))(**msg)
            reply["ok"] = True
        except Exception as exc:  # reported to the test, which fails with it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), file=replies, flush=True)
    for obj in list(peer.objects.values()):
        obj.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


class Child:
    """The test side of a kv_peer process: call() waits for the reply, post() does not."""

    def __init__(self, timeout: float = 60.0) -> None:
        import os
        import subprocess
        import tempfile
        from pathlib import Path

        root = Path(__file__).resolve().parents[2]
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.kv_peer"], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env={**os.environ, "PYTHONPATH": str(root)})
        self.pending = 0
        assert self._read(timeout)["ready"]

    def _read(self, timeout: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"kv_peer gave no reply within {timeout}s; stderr: {self.log()[-2000:]}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kv_peer exited; stderr: {self.log()[-2000:]}")
        return json.loads(line)

    def post(self, cmd: str, **kwargs) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        self.pending += 1

    def call(self, cmd: str, timeout: float = 30.0, **kwargs) -> dict:
        self.post(cmd, **kwargs)
        while self.pending > 1:  # replies of earlier posts come first
            self._read(timeout)
            self.pending -= 1
        reply = self._read(timeout)
        self.pending -= 1
        if not reply.pop("ok"):
            raise RuntimeError(f"kv_peer {cmd} failed: {reply['error']}")
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
                self.proc.wait(timeout=10)
            except Exception:
                self.kill()
        self.stderr.close()
