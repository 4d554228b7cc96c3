"""The served matrix of tensor parallelism: the router's gRPC server in front of a prefill worker
of TP P and a decode worker of TP D, (P, D) in {1, 2}^2, over nixl and over grpc, with real
follower processes: concurrent greedy streams equal a colocated TP=1 engine's tokens (which equal
Hugging Face transformers', test_hf_parity.py; the engine is the reference because transformers'
`min_new_tokens` suppresses EOS, which `ignore_eos` still samples) under the near-tie rule of
test_tensor_parallel.py, and every page comes back on both workers. The tiny llama has 2 KV
heads: at TP=2 each rank holds one, so a 2 -> 1 transfer joins two ranks' heads in one decode
rank and 1 -> 2 splits them. Under load: 32 concurrent streams across P=2 -> D=1 and P=1 -> D=2
(the slow suite), 0 lost, 0 leaked.

The default run covers 2 -> 1 over nixl, 1 -> 2 over grpc and 2 -> 2 over nixl; the rest of the
matrix is in the slow suite.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import ENGINE, Loop, close, collect, in_process, random_prompts, stub, wait_free
from tests.integration.test_tensor_parallel import NEW_TOKENS, assert_greedy_matches

LENGTHS = (1, 7, 16, 17, 40, 100)
FAST = {(2, 1, "nixl"), (1, 2, "grpc"), (2, 2, "nixl")}
MATRIX = [pytest.param(p, d, t, marks=() if (p, d, t) in FAST else pytest.mark.slow, id=f"p{p}-d{d}-{t}")
          for t in ("nixl", "grpc") for p in (1, 2) for d in (1, 2)]


def _serve(model, p_tp: int, d_tp: int, transport: str, num_pages: int = 96):
    from decode_worker.worker import DecodeWorker
    from kv_transfer.config import TransferConfig
    from prefill_worker.worker import PrefillWorker

    cfg = TransferConfig(host="127.0.0.1", deadline_s=30)
    prefill = PrefillWorker(model, transport=transport, transfer_config=cfg, page_size=16, num_pages=num_pages,
                            tensor_parallel_size=p_tp, **ENGINE)
    try:
        decode = DecodeWorker(model, transport=transport, transfer_config=cfg, page_size=8, num_pages=2 * num_pages,
                              tensor_parallel_size=d_tp, **ENGINE)
    except BaseException:
        prefill.core.close()
        raise
    ph, dh = in_process(prefill, "prefill-0", "prefill"), in_process(decode, "decode-0", "decode")
    loop = Loop()
    server = loop.run(_start(model, [ph], [dh]))
    return server, loop, (ph, dh), (prefill, decode)


async def _start(model, prefills, decodes):
    server = build_router(model, prefills, decodes, max_model_len=256)
    await server.start()
    return server


def _stop(server, loop, handles) -> None:
    loop.run(server.stop(1.0))
    close(*handles)
    loop.close()


def _streams(server, prompts):
    s = stub(server)
    sampling = pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: collect(s, pb.GenerateRequest(prompt_token_ids=p, sampling=sampling)), prompts))


def _outputs(results):
    return [SimpleNamespace(token_ids=ids, finish_reason=last.finish_reason) for ids, _, last in results]


def tp1_greedy(model, prompts) -> list[list[int]]:
    """The colocated TP=1 engine's greedy tokens (engine.LLM)."""
    from engine import LLM, SamplingParams

    llm = LLM(model, page_size=16, num_pages=512, max_model_len=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.close()
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model):
    model = tiny_model("llama")
    prompts = random_prompts(list(LENGTHS), 2048, seed=35)
    return model, prompts, tp1_greedy(model, prompts)


@pytest.mark.parametrize("p_tp, d_tp, transport", MATRIX)
def test_served_tokens_equal_transformers_across_tp(p_tp, d_tp, transport, reference):
    model, prompts, expected = reference
    server, loop, handles, (prefill, decode) = _serve(model, p_tp, d_tp, transport)
    try:
        results = _streams(server, prompts)
        assert_greedy_matches(f"served P_TP={p_tp} D_TP={d_tp} {transport}", model, prompts, _outputs(results),
                              expected)
        assert all(last.placement.prefill_worker == "prefill-0" for _, _, last in results)  # a remote prefill each
        status = wait_free(stub(server))
        assert len(status.workers) == 2
    finally:
        _stop(server, loop, handles)


@pytest.mark.slow
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_32_concurrent_streams_lose_nothing_and_leak_nothing(p_tp, d_tp, transport, reference):
    model, _, _ = reference
    prompts = random_prompts([5 + 6 * i for i in range(32)], 2048, seed=36)  # + 32 new tokens <= 256
    expected = tp1_greedy(model, prompts)
    server, loop, handles, _ = _serve(model, p_tp, d_tp, transport, num_pages=256)
    try:
        results = _streams(server, prompts)
        assert len(results) == 32
        assert_greedy_matches(f"32 streams P_TP={p_tp} D_TP={d_tp} {transport}", model, prompts, _outputs(results),
                              expected)
        wait_free(stub(server))
    finally:
        _stop(server, loop, handles)
