"""Batched token sampler: one decode step's logits [B, V] in, one token (and logprobs) per row out.

Owns greedy/temperature/top-k/top-p/min-p sampling, per-request seeded generators and raw
logprobs. Must not know about requests, the scheduler or the KV cache.

Reproducibility contract: a row's token depends only on its own logits, its own params and
its own generator, never on which other rows share the batch. So every filter is expressed
as a per-row logit *threshold* (ties at the cut are kept, whatever order a sort put them in),
the draw walks the kept tokens in vocabulary order, and each row consumes exactly one
uniform from its own generator per step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

# Top-p needs the tokens sorted by probability. A full sort of V=32k is ~1 ms per row on a
# CPU; the nucleus almost always fits in the top few hundred, so sort only those and fall
# back to the full row when the nucleus reaches the end of the candidates.
_TOP_P_CANDIDATES = 256


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log-softmax of the raw logits, before temperature and filters
    rank: int  # 1-based rank of the chosen token among the raw logits
    top: list[tuple[int, float]]  # top-n (id, logprob) by raw logprob, n = params.logprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator. Unseeded requests get fresh OS entropy so they differ."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return g


class Sampler:
    """Stateless; one instance can serve every batch."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"sampler got {batch} logit rows, {len(params)} params, {len(generators)} generators"
            )
        want_logprobs = False
        all_greedy = True
        for p in params:
            if p.logprobs is not None:
                want_logprobs = True
            if not (p.temperature == 0.0 or p.top_k == 1):
                all_greedy = False
        if all_greedy and not want_logprobs:
            # Decode hot path: argmax is exact in the model dtype, no float32 copy needed.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * batch)

        logits = logits.float()
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sampled = _sample_rows(
                logits.index_select(0, rows),
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
            token_ids = token_ids.index_copy(0, rows, sampled)
        ids = token_ids.tolist()
        lps: list[TokenLogprobs | None] = [None] * batch
        if want_logprobs:
            _fill_logprobs(logits, token_ids, params, lps)
        return SamplerOutput(ids, lps)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sample one token per row of float32 `logits` [R, V]; every row is non-greedy."""
    rows, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev)
    x = logits / temps.unsqueeze(1)

    # Every filter becomes a per-row logit threshold: keep x >= thr.
    thr = x.new_full((rows,), -math.inf)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in ks):
        kmax = max(k for k in ks if k < vocab)
        kth = torch.topk(x, kmax, dim=-1, sorted=True).values
        k_idx = torch.tensor([min(k, kmax) - 1 for k in ks], device=dev)
        thr_k = kth.gather(1, k_idx.unsqueeze(1)).squeeze(1)
        limited = torch.tensor([k < vocab for k in ks], device=dev)
        thr = torch.where(limited, thr_k, thr)
    if any(tp < 1.0 for tp in top_ps):
        thr = torch.maximum(thr, _top_p_threshold(x, thr, ks, top_ps))
    min_ps = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_ps):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); renormalising after
        # top-k/top-p does not change the ratio, so the order of the filters is immaterial here.
        log_mp = torch.tensor([math.log(mp) if mp > 0 else -math.inf for mp in min_ps], device=dev)
        thr = torch.maximum(thr, x.amax(dim=-1) + log_mp)

    probs = torch.softmax(x.masked_fill(x < thr.unsqueeze(1), -math.inf), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.cat([torch.rand(1, device=dev, generator=g) for g in generators])
    # right=True: a dropped token has zero mass, so its cdf equals its predecessor's and it
    # can never be the first entry strictly above the target.
    target = (u * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total (p ~ 2**-24): take the top token rather than run off the end.
    return torch.where(picked < vocab, picked, x.argmax(dim=-1))


def _top_p_threshold(
    x: torch.Tensor, thr_k: torch.Tensor, ks: list[int], top_ps: list[float]
) -> torch.Tensor:
    """Per-row logit of the last token inside the nucleus (-inf for rows with top_p == 1).

    Probabilities are renormalised over the top-k survivors. The cumulative sum over
    descending probabilities is the same sequence whichever order ties were sorted in, and
    its prefix does not depend on how many candidates were taken, so the candidate shortcut
    and the full sort give the same threshold.
    """
    rows, vocab = x.shape
    dev = x.device
    out = x.new_full((rows,), -math.inf)
    active_l = [i for i, tp in enumerate(top_ps) if tp < 1.0]
    active = torch.tensor(active_l, device=dev)
    xa = x.index_select(0, active)
    masked = xa.masked_fill(xa < thr_k.index_select(0, active).unsqueeze(1), -math.inf)
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    top_p = torch.tensor([top_ps[i] for i in active_l], device=dev).unsqueeze(1)

    # Rows limited by top-k need no more candidates than their k.
    n_cand = min(vocab, max([_TOP_P_CANDIDATES] + [ks[i] for i in active_l if ks[i] < vocab]))
    cand = torch.topk(masked, n_cand, dim=-1, sorted=True).values
    value, n_keep = _nucleus_cut(cand, top_p, lse)
    if n_cand < vocab:
        # The nucleus reached the last candidate, so it may continue past it: redo those rows.
        redo = (n_keep >= n_cand).nonzero().squeeze(1)
        if redo.numel():
            full = torch.sort(masked.index_select(0, redo), dim=-1, descending=True).values
            redo_value, _ = _nucleus_cut(full, top_p.index_select(0, redo), lse.index_select(0, redo))
            value = value.index_copy(0, redo, redo_value)
    return out.index_copy(0, active, value)


def _nucleus_cut(
    desc: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logit of the last kept token, kept count) for logits sorted descending."""
    mass = torch.exp(desc - lse)
    before = torch.cumsum(mass, dim=-1) - mass
    n_keep = (before < top_p).sum(dim=-1)  # a prefix, and >= 1 because top_p > 0
    return desc.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1), n_keep


def _fill_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    params: list[SamplingParams],
    out: list[TokenLogprobs | None],
) -> None:
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    rows = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    chosen_ids = token_ids.index_select(0, rows)
    chosen = lp.gather(1, chosen_ids.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    n_top = max(params[i].logprobs for i in want)
    top_vals: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if n_top:
        vals, idx = torch.topk(lp, n_top, dim=-1)
        top_vals, top_ids = vals.tolist(), idx.tolist()
    chosen_l = chosen.squeeze(1).tolist()
    ids_l = chosen_ids.tolist()
    for j, i in enumerate(want):
        n = params[i].logprobs
        top = list(zip(top_ids[j][:n], top_vals[j][:n]))
        out[i] = TokenLogprobs(ids_l[j], chosen_l[j], ranks[j], top)
