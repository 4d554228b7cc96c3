"""engine.cpu_linear: the oneDNN path computes the same product as F.linear, is used only for
2..MAX_ROWS rows of big weights, and a model with packed layers keeps its parameters and
generates exactly what Hugging Face does (batched decode goes through the packed path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import SamplingParams
from engine.cpu_linear import MAX_ROWS, MIN_WEIGHT_BYTES, PackedLinear, pack_linears, packing_available
from tests.hf_reference import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [1, 2, 3, 8, MAX_ROWS, MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 256, generator=g)
    b = torch.randn(1024, generator=g) if bias else None
    x = torch.randn(rows, 256, generator=g)
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_only_small_batches_take_the_onednn_path(monkeypatch):
    lin = PackedLinear(torch.randn(512, 512), None)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 2, MAX_ROWS, MAX_ROWS + 1, 512):
        lin(torch.randn(rows, 512))
    assert calls == [2, MAX_ROWS]


def test_pack_linears_swaps_big_weights_and_keeps_parameters():
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(64, 64, bias=False))
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    added = pack_linears(model)
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear
    assert added == model[0].weight.nbytes >= MIN_WEIGHT_BYTES
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # same tensors, same names


def test_small_preset_packs_and_matches_transformers(make_llm):
    from engine.builtin import ensure_builtin
    from engine.config import ModelConfig

    model_dir = ensure_builtin(arch="llama", preset="small")
    prompts = random_prompts((3, 9, 17, 40, 64, 100, 130, 7), ModelConfig.from_pretrained(model_dir).vocab_size, seed=5)
    llm = make_llm(model_dir, dtype="float32")
    model = llm.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, prompts, 24)
