"""Model execution shared by the prefill and decode workers: HF checkpoint loader, models,
paged KV cache, block pool with prefix hashes, attention backends, sampler, scheduler, runner.

Must not import Ray, the router, the workers or kv_transfer.
"""
from engine.sampling_params import SamplingParams
from engine.outputs import RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    # LLM pulls in torch-heavy modules; import it on first use so `import engine` stays light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
