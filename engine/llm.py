"""`LLM`: the colocated engine in one process (prefill and decode on the same pages).

    llm = LLM(model_dir)                        # or a built-in name: "tiny", "qwen3-small", ...
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

`LLM(model_dir, tensor_parallel_size=2)` runs the model over 2 ranks: this process leads, one
follower process holds the other half of every layer's heads (engine/parallel.py); `close()`
(or garbage collection, or exit) stops it.

Streaming users call `add_request` and then `step()` until `has_unfinished_requests()` is
False; each step returns the requests whose output changed, with `new_token_ids`/`new_text`.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.core import EngineCore, Prompt, resolve_model
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "resolve_model"]


class LLM(EngineCore):
    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        base = next(self._ids)
        reqs = [self.make_request(p, sp, f"gen-{base}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        for req in reqs:  # all validated before any is queued
            self.add(req)
        final: dict[str, RequestOutput] = {}
        ids = {r.request_id for r in reqs}
        while len(final) < len(reqs):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]
