"""`pdcluster serve` as users run it: SERVING, `pdcluster generate` and `pdcluster status`
answer, `pdcluster drain` lets a running stream finish and refuses new ones, and SIGTERM
stops with exit code 0, leaving no Ray processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.slow  # a third cluster start (~30 s here); the Ray path is covered by test_cluster_ray


def test_serve_generate_status_sigterm(tmp_path, tiny_model):
    tiny_model("llama")
    ready = tmp_path / "addr"
    exe = [sys.executable, "-m", "cluster.cli"]
    proc = subprocess.Popen(exe + ["serve", "--model", "tiny", "--port", "0", "--http-port", "0",
                                   "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def started() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            return ready.exists()

        wait_until(started, 240, 0.2, "pdcluster serve writing its ready file")
        addr = ready.read_text()
        gen = subprocess.run(exe + ["generate", "--address", addr, "hello", "--max-tokens", "5", "--temperature", "0",
                              "--show-ids"],
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0 and "finish=length" in gen.stderr and "tokens/s" in gen.stderr, gen.stderr
        ids_line = [line for line in gen.stdout.splitlines() if line.startswith("ids: [")]
        assert len(ids_line) == 1 and len(ids_line[0][5:].strip("[]").split(",")) == 5, gen.stdout
        st = subprocess.run(exe + ["status", "--address", addr], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "prefill-0" in st.stdout and "decode-0" in st.stdout, st.stdout
        # `serve` starts the node's KV store by default, and status shows it
        assert "KV store kv-store-0 on 127.0.0.1: ok" in st.stdout, st.stdout
        import grpc

        from proto.pdcluster.v1 import inference_pb2 as pb
        from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

        stub = pb_grpc.InferenceStub(grpc.insecure_channel(addr))
        long = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=1000, temperature=0,
                                                                             ignore_eos=True))
        call = stub.Generate(long, timeout=120)
        first = next(call)
        drain = subprocess.Popen(exe + ["drain", "--address", addr, "--grace", "60"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        rest = list(call)  # the running stream is not cut by the drain
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 1000
        out, _ = drain.communicate(timeout=90)
        assert drain.returncode == 0 and "0 cancelled" in out, out
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(long, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        assert "draining" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left in the serve session: {left}"
