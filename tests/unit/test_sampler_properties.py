"""The sampler over the whole range validation admits (property-based, hypothesis): every
temperature from subnormal to huge, every top-k/top-p/min-p combination, logits with ties,
-inf entries, rows of equal or all -inf values. Every draw is a token id in range that the
request's filters allow, the batch never raises, and a row's token does not depend on the
other rows of its batch."""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, request_seed
from engine.sampling_params import SamplingParams


def sample(logits, params, seeds, position=0):
    return Sampler()(logits, params, seeds, [position] * len(seeds))


VOCAB = 12
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

temperatures = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e308, allow_subnormal=True,
                                                  exclude_min=True))
params = st.builds(
    SamplingParams,
    max_tokens=st.just(4),
    temperature=temperatures,
    top_k=st.integers(-1, VOCAB + 3),
    top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_subnormal=True),
    min_p=st.floats(min_value=0.0, max_value=1.0, allow_subnormal=True),
    seed=st.integers(-(2**63), 2**64 - 1),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
)
logit = st.one_of(st.floats(min_value=-(2.0**127), max_value=2.0**127, width=32), st.just(-math.inf),
                  st.sampled_from([0.0, 1.0]))
rows = st.one_of(
    st.lists(logit, min_size=VOCAB, max_size=VOCAB),
    st.builds(lambda v: [v] * VOCAB, logit),  # all equal, all -inf included
)


def allowed(row: list[float], p: SamplingParams) -> set[int]:
    """Token ids the filters can let through: within the top-k by logit (ties kept), and finite
    unless the row has no finite logit at all."""
    ids = set(range(VOCAB))
    finite = [i for i in ids if row[i] > -math.inf]
    if finite:
        ids = set(finite)
    if 0 < p.top_k < VOCAB:
        kth = sorted((row[i] for i in ids), reverse=True)[min(p.top_k, len(ids)) - 1]
        ids = {i for i in ids if row[i] >= kth}
    return ids


@SETTINGS
@given(st.lists(st.tuples(rows, params), min_size=1, max_size=5))
def test_every_admitted_request_samples_an_allowed_token(batch):
    logits = torch.tensor([r for r, _ in batch], dtype=torch.float32)
    ps = [p for _, p in batch]
    gens = [request_seed(p.seed) for p in ps]
    out = sample(logits, ps, gens)
    assert len(out.token_ids) == len(batch)
    for (row, p), tok, lp in zip(batch, out.token_ids, out.logprobs):
        assert 0 <= tok < VOCAB
        assert tok in allowed(row, p), (row, p, tok)
        if p.logprobs is not None:
            assert lp is not None and lp.token_id == tok and len(lp.top) == min(p.logprobs, VOCAB)


@SETTINGS
@given(rows, params, st.lists(st.tuples(rows, params), min_size=1, max_size=3))
def test_a_rows_token_does_not_depend_on_its_batch(row, p, others):
    alone = sample(torch.tensor([row]), [p], [request_seed(p.seed)])
    batch = [(row, p), *others]
    together = sample(torch.tensor([r for r, _ in batch]), [q for _, q in batch],
                         [request_seed(q.seed) for _, q in batch])
    assert together.token_ids[0] == alone.token_ids[0]


def test_a_tiny_temperature_samples_a_largest_logit():
    row = [0.0, 3.0, 1.0, 3.0, -math.inf, 2.0]
    for t in (5e-324, 1e-300, 1e-30):
        p = SamplingParams(temperature=t, seed=1)
        tok = sample(torch.tensor([row]), [p], [request_seed(1)]).token_ids[0]
        assert tok in (1, 3)


def test_a_huge_temperature_samples_every_finite_token_and_no_masked_one():
    row = [0.0, 30.0, -20.0, -math.inf]
    p = SamplingParams(temperature=1e308)
    seen = {sample(torch.tensor([row]), [p], [request_seed(s)]).token_ids[0] for s in range(200)}
    assert seen == {0, 1, 2}
