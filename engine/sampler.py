"""Batched token sampler: one decode step's logits [B, V] in, one token (and logprobs) per row out.

Owns greedy/temperature/top-k/top-p/min-p sampling, the per-draw uniforms and raw logprobs.
Must not know about requests, the scheduler or the KV cache.

Reproducibility contract: a row's token depends only on its own logits, its own params, its
seed and the position of the token it samples, never on which other rows share the batch,
nor on where the earlier tokens were sampled. So every filter is expressed as a per-row
*threshold* (top-k on logits, top-p and min-p on probabilities; ties at the cut are all
kept, whatever order a sort put them in), the draw walks the kept tokens in vocabulary
order, and its uniform is `draw_uniform(seed, position)`: a counter-based generator, with no
state to carry. A prefill worker that samples a request's first token and the decode worker
that samples the rest, or a stream that moves to another decode worker half-way, therefore
draw exactly the uniforms one uninterrupted run would.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams

# Top-p needs the tokens sorted by probability. A full sort of V=32k costs milliseconds per
# row on a CPU, while the nucleus usually fits in the top few hundred: sort only those, and
# widen to the next size (then the full row) for rows whose nucleus reaches the last one.
_TOP_P_CANDIDATES = (256, 4096)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that avalanches every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def request_seed(seed: int | None) -> int:
    """The 64-bit key of a request's draws: its seed (any value SamplingParams admits), or
    fresh OS entropy for an unseeded request, so two unseeded requests differ."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    return seed & _MASK64


def draw_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that samples the token at `position` (its index in prompt + output)
    of a request keyed `seed`: a pure function (two splitmix64 rounds over seed and position),
    53 random bits."""
    h = _mix64((_mix64(seed & _MASK64) + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64)
    return (h >> 11) * (1.0 / (1 << 53))


class Sampler:
    """Stateless; one instance can serve every batch."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
    ) -> SamplerOutput:
        """`seeds[i]` (engine.sampler.request_seed) and `positions[i]` (the index the sampled
        token takes in row i's prompt + output) key row i's draw; greedy rows ignore them."""
        batch = logits.shape[0]
        if not len(params) == len(seeds) == len(positions) == batch:
            raise ValueError(f"sampler got {batch} logit rows, {len(params)} params, {len(seeds)} seeds, "
                             f"{len(positions)} positions")
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
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == batch:
            token_ids = _sample_rows(logits, params, [draw_uniform(seeds[i], positions[i]) for i in range(batch)])
        else:
            token_ids = logits.argmax(dim=-1)
            if random_rows:
                rows = torch.tensor(random_rows, device=logits.device)
                sampled = _sample_rows(
                    logits.index_select(0, rows),
                    [params[i] for i in random_rows],
                    [draw_uniform(seeds[i], positions[i]) for i in random_rows],
                )
                token_ids = token_ids.index_copy(0, rows, sampled)
        ids = token_ids.tolist()
        lps: list[TokenLogprobs | None] = [None] * batch
        if want_logprobs:
            _fill_logprobs(logits, token_ids, params, lps)
        return SamplerOutput(ids, lps)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Sample one token per row of float32 `logits` [R, V]; every row is non-greedy."""
    rows, vocab = logits.shape
    dev = logits.device
    temps = [p.temperature for p in params]
    x = torch.nan_to_num(logits, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    topk_ids: torch.Tensor | None = None
    if any(k < vocab for k in ks):
        # Keep logits >= the k-th largest (on the raw logits: the ranking is the temperature's
        # too, and float rounding after scaling could tie values that differ); rows without
        # top-k get a -inf threshold.
        kmax = max(k for k in ks if k < vocab)
        kth, topk_ids = torch.topk(x, kmax, dim=-1, sorted=True)
        thr_k = kth.gather(1, torch.tensor([min(k, kmax) - 1 for k in ks], device=dev).unsqueeze(1))
        limited = torch.tensor([k < vocab for k in ks], device=dev).unsqueeze(1)
        x = x.masked_fill(limited & (x < thr_k), -math.inf)
    # Measured from each row's largest logit, before the temperature divides it: the largest
    # become 0 and the rest <= 0, so no temperature (subnormal or huge) and no infinite logit
    # can make a nan. A row whose largest is +inf keeps only those; a row of -inf (or nan)
    # logits has no preference left, and samples uniformly.
    x = x - x.amax(dim=-1, keepdim=True)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)  # inf - inf: the maxima of those rows
    if not all(t == 1.0 for t in temps):
        # float32 holds neither a subnormal temperature nor 1e308: clamped to its range, a tiny
        # one still sends every logit below the largest to -inf, and a huge one every finite
        # logit to ~0 while -inf stays -inf (an overflow to inf would make -inf / inf a nan)
        f32 = torch.finfo(torch.float32)
        t = torch.tensor([min(max(t, f32.tiny), f32.max) for t in temps], device=dev)
        x = x / t.unsqueeze(1)
    # Work in probabilities from here: exp() over -inf entries is a slow path on CPUs, the
    # fused softmax is not, and top-p and min-p are both defined on probabilities.
    probs = torch.softmax(x, dim=-1)

    # Top-p and min-p become per-row probability thresholds: keep probs >= thr.
    thr: torch.Tensor | None = None
    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        thr = _top_p_threshold(probs, ks, top_ps, topk_ids)
    min_ps = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_ps):
        # Renormalising after top-p does not change prob / max_prob, so this is min-p applied
        # after top-p without a second softmax.
        mp = torch.tensor(min_ps, device=dev) * probs.amax(dim=-1)
        thr = mp if thr is None else torch.maximum(thr, mp)
    if thr is not None:
        probs = probs.masked_fill(probs < thr.unsqueeze(1), 0.0)

    cdf = torch.cumsum(probs, dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=dev)
    # right=True: a dropped token has zero mass, so its cdf equals its predecessor's and it
    # can never be the first entry strictly above the target.
    target = (u * cdf[:, -1].double()).to(cdf.dtype).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    overflow = picked >= vocab
    if overflow.any():
        # u * total rounded up to total (p ~ 2**-24): take the top token, not one past the end.
        picked = torch.where(overflow, probs.argmax(dim=-1), picked)
    return picked


def _top_p_threshold(
    probs: torch.Tensor, ks: list[int], top_ps: list[float], topk_ids: torch.Tensor | None
) -> torch.Tensor:
    """Per-row probability of the last token inside the nucleus (0 for rows with top_p == 1).

    The cumulative sum over descending probabilities is the same sequence whichever order
    ties were sorted in, and its prefix does not depend on how many candidates were taken,
    so every candidate size, and the full sort, give the same threshold. `topk_ids` are the
    top-k pass's candidates, already holding every surviving token of rows limited by top-k.
    """
    rows, vocab = probs.shape
    dev = probs.device
    active_l = [i for i, tp in enumerate(top_ps) if tp < 1.0]
    active = torch.tensor(active_l, device=dev)
    pa = probs.index_select(0, active)
    top_p = torch.tensor([top_ps[i] for i in active_l], device=dev).unsqueeze(1)

    # Rows limited by top-k need no more candidates than their k.
    first = max([_TOP_P_CANDIDATES[0]] + [ks[i] for i in active_l if ks[i] < vocab])
    sizes = sorted({min(n, vocab) for n in (first, *_TOP_P_CANDIDATES[1:]) if n >= first} | {vocab})
    value = probs.new_zeros(len(active_l))
    pending = torch.arange(len(active_l), device=dev)
    gathered = topk_ids is not None and all(ks[i] < vocab for i in active_l)
    if gathered:
        sizes = [topk_ids.shape[1]] + [n for n in sizes if n > topk_ids.shape[1]]
    for stage, n_cand in enumerate(sizes):
        rows_p = pa.index_select(0, pending)
        if gathered and stage == 0:
            # Sorting the gathered survivors is cheaper than another top-k over the vocabulary.
            ids = topk_ids.index_select(0, active).index_select(0, pending)
            desc = torch.sort(rows_p.gather(1, ids), dim=-1, descending=True).values
        elif n_cand < vocab:
            desc = torch.topk(rows_p, n_cand, dim=-1, sorted=True).values
        else:
            desc = torch.sort(rows_p, dim=-1, descending=True).values
        before = torch.cumsum(desc, dim=-1) - desc
        n_keep = (before < top_p.index_select(0, pending)).sum(dim=-1).clamp(min=1)  # >= 1 as top_p > 0
        value = value.index_copy(0, pending, desc.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1))
        # The nucleus reached the last candidate, so it may continue past it: widen those rows.
        pending = pending[n_keep >= n_cand]
        if not pending.numel():
            break
    return probs.new_zeros(rows).index_copy(0, active, value)


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
