"""Benchmark workloads: request arrival times and prompt/output lengths, from public traces
(Azure LLM inference CSV, Mooncake JSONL with shared-prefix block ids) or random.

`build_workload` cuts, rescales lengths to fit a model, and rescales or regenerates arrival
times; `materialize_prompts` turns lengths and prefix block ids into token ids so that
requests sharing a Mooncake block id share the same tokens (prefix caching can see it).
The simulator and the real client read the same `Workload`, so both see identical load.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
# Token ids below this are left alone: built-in and HF vocabularies put pad/bos/eos/special there.
DEFAULT_RESERVED_IDS = 10

# --dataset name -> (file under <data>/traces, format)
DATASETS: dict[str, tuple[str, str]] = {
    "azure-conv": ("azure_conv_2023.csv", "azure"),
    "azure-code": ("azure_code_2023.csv", "azure"),
    "mooncake-conv": ("mooncake_conversation.jsonl", "mooncake"),
    "mooncake-synth": ("mooncake_synthetic.jsonl", "mooncake"),
}
# the same traces under the names their publishers give them, also looked for in the data folder
PUBLISHED_NAMES: dict[str, tuple[str, ...]] = {
    "azure-conv": ("AzureLLMInferenceTrace_conv.csv",),
    "azure-code": ("AzureLLMInferenceTrace_code.csv",),
    "mooncake-conv": ("conversation_trace.jsonl",),
    "mooncake-synth": ("synthetic_trace.jsonl",),
}
# where a user gets them
SOURCES = {
    "azure": "https://github.com/Azure/AzurePublicDataset (AzureLLMInferenceTrace_conv.csv / _code.csv, 2023)",
    "mooncake": "https://github.com/kvcache-ai/Mooncake (FAST25-release/traces: conversation_trace.jsonl, "
                "synthetic_trace.jsonl)",
}
FORMATS = ("azure", "mooncake")
KINDS = (*DATASETS, "random")


@dataclass(slots=True)
class WorkloadRequest:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt_len: int
    output_len: int
    prefix_blocks: tuple[int, ...] = ()  # shared-prefix block ids (Mooncake hash_ids)
    prompt_token_ids: list[int] | None = None
    decode_worker: str = ""  # pin to this decode (or colocated) worker; empty: the router places it


@dataclass
class Workload:
    requests: list[WorkloadRequest]
    block_tokens: int  # tokens per prefix block after length scaling; 0 when there are none
    name: str
    meta: dict[str, float] = field(default_factory=dict)  # scaling actually applied


def data_dir() -> Path:
    """Where named traces are looked for: $PDCLUSTER_DATA (its traces/ folder, or itself), else a
    development checkout's sibling data folder."""
    env = os.environ.get("PDCLUSTER_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"  # <repo>/loadgen/workloads.py


def dataset_path(name: str) -> Path:
    """The file of a named dataset: the first of its names found in the data folder's traces/
    (or the data folder itself); the expected place when none is there."""
    if name not in DATASETS:
        raise ValueError(f"dataset {name!r} unknown; allowed: {', '.join(KINDS)}, or a trace file's path")
    root = data_dir()
    for folder in (root / "traces", root):
        for fname in (DATASETS[name][0], *PUBLISHED_NAMES[name]):
            if (folder / fname).is_file():
                return folder / fname
    return root / "traces" / DATASETS[name][0]


def format_of(path: str | Path) -> str:
    """A trace file's format from its name: .csv is azure, .jsonl/.json is mooncake."""
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return "azure"
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    raise ValueError(f"cannot tell the format of {str(path)!r} from its name: pass --dataset-format azure|mooncake")


def missing_dataset(name: str) -> str:
    fmt = DATASETS[name][1]
    names = " or ".join((DATASETS[name][0], *PUBLISHED_NAMES[name]))
    return (f"dataset {name}: no trace file ({names}) in {data_dir() / 'traces'}; get it from {SOURCES[fmt]}, "
            f"then put it in $PDCLUSTER_DATA/traces or pass its path as --dataset PATH")


def load_azure(path: str | Path) -> Workload:
    """Azure LLM inference trace CSV, as published (TIMESTAMP, ContextTokens, GeneratedTokens) or
    as processed by Vidur (arrived_at in s, num_prefill_tokens, num_decode_tokens)."""
    requests = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols = set(reader.fieldnames or ())
        published = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols
        missing = set() if published else {"arrived_at", "num_prefill_tokens", "num_decode_tokens"} - cols
        if missing:
            raise ValueError(f"{path}: azure trace lacks column(s) {sorted(missing)} (or the published "
                             f"TIMESTAMP, ContextTokens, GeneratedTokens)")
        for i, row in enumerate(reader, 2):
            try:
                if published:
                    t, p, o = _timestamp_s(row["TIMESTAMP"]), row["ContextTokens"], row["GeneratedTokens"]
                else:
                    t, p, o = float(row["arrived_at"]), row["num_prefill_tokens"], row["num_decode_tokens"]
                requests.append(WorkloadRequest(len(requests), t, max(1, int(p)), max(1, int(o))))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{i}: bad azure record ({exc})") from exc
    return Workload(requests, 0, Path(path).stem)


def _timestamp_s(text: str) -> float:
    """Seconds since the epoch of a published Azure TIMESTAMP ('2023-11-16 18:15:46.6805900': up to
    seven fractional digits, more than datetime parses)."""
    import datetime

    head, _, frac = text.strip().partition(".")
    dt = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp() + (float("0." + frac) if frac else 0.0)


def load_mooncake(path: str | Path) -> Workload:
    """Mooncake trace JSONL: timestamp (ms), input_length, output_length, hash_ids (per 512 tokens)."""
    requests = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = WorkloadRequest(len(requests), float(obj["timestamp"]) / 1000.0, max(1, int(obj["input_length"])),
                                      max(1, int(obj["output_length"])), tuple(int(h) for h in obj.get("hash_ids", ())))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: bad mooncake record ({exc})") from exc
            requests.append(req)
    return Workload(requests, MOONCAKE_BLOCK_TOKENS, Path(path).stem)


def random_workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> Workload:
    """n requests, lengths uniform in the inclusive ranges, all arriving at t=0."""
    for name, (lo, hi) in (("input_range", input_range), ("output_range", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got {lo}:{hi}")
    rng = random.Random(seed)
    reqs = [WorkloadRequest(i, 0.0, rng.randint(*input_range), rng.randint(*output_range)) for i in range(n)]
    return Workload(reqs, 0, "random")


def fit_length_scale(workload: Workload, max_model_len: int) -> float:
    """Largest scale <= 1 with which every prompt+output fits max_model_len."""
    longest = max((r.prompt_len + r.output_len for r in workload.requests), default=0)
    return 1.0 if longest <= max_model_len else max_model_len / longest


def scale_lengths(workload: Workload, scale: float, max_model_len: int | None = None) -> Workload:
    """Multiply prompt/output lengths and block_tokens by scale (>= 1 token each), then clamp to
    max_model_len; a prompt shorter than its blocks keeps only the blocks it still covers."""
    if scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {scale}")
    block = max(1, round(workload.block_tokens * scale)) if workload.block_tokens else 0
    out = []
    for r in workload.requests:
        p, o = max(1, round(r.prompt_len * scale)), max(1, round(r.output_len * scale))
        if max_model_len is not None:
            if max_model_len < 2:
                raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
            o = min(o, max_model_len - 1)
            p = min(p, max_model_len - o)
        blocks = r.prefix_blocks[: p // block] if block else ()
        out.append(replace(r, prompt_len=p, output_len=o, prefix_blocks=blocks, prompt_token_ids=None))
    return Workload(out, block, workload.name, dict(workload.meta, length_scale=scale))


def gamma_arrivals(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival offsets with gamma inter-arrival gaps: mean 1/rate, shape burstiness (1 = Poisson);
    the first request arrives at 0."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, times = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


def build_workload(kind: str, *, path: str | Path | None = None, num_requests: int | None = None,
                   time_scale: float = 1.0, length_scale: float | None = None, max_model_len: int | None = None,
                   request_rate: float | None = None, burstiness: float = 1.0, seed: int = 0,
                   input_range: tuple[int, int] = (32, 128), output_range: tuple[int, int] = (16, 64)) -> Workload:
    """kind: a --dataset name, "random", or "azure"/"mooncake" with path. length_scale None
    means fit to max_model_len (if given); request_rate None/inf keeps trace times (random: t=0)."""
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if kind == "random":
        wl = random_workload(num_requests or 100, input_range, output_range, seed)
    else:
        fmt = kind
        if kind in DATASETS:
            fmt = DATASETS[kind][1]
            if path is None:
                path = dataset_path(kind)
                if not path.is_file():
                    raise ValueError(missing_dataset(kind))
        elif kind not in FORMATS and path is None and Path(kind).is_file():  # --dataset PATH
            path, fmt = kind, format_of(kind)
        if fmt not in FORMATS:
            raise ValueError(f"workload {kind!r} is neither a dataset name ({', '.join(KINDS)}) nor a trace file")
        if path is None:
            raise ValueError(f"format {fmt!r} needs a path")
        wl = (load_azure if fmt == "azure" else load_mooncake)(path)
        if num_requests is not None:
            wl.requests = wl.requests[:num_requests]
        if not wl.requests:
            raise ValueError(f"{path}: trace has no requests")
        t0 = wl.requests[0].arrival_s
        for r in wl.requests:
            r.arrival_s = (r.arrival_s - t0) * time_scale
        wl.meta["time_scale"] = time_scale
    if length_scale is None:
        length_scale = fit_length_scale(wl, max_model_len) if max_model_len else 1.0
    if length_scale != 1.0 or max_model_len is not None:
        wl = scale_lengths(wl, length_scale, max_model_len)
    if request_rate is not None and not math.isinf(request_rate):
        for r, t in zip(wl.requests, gamma_arrivals(len(wl.requests), request_rate, burstiness, seed)):
            r.arrival_s = t
        wl.meta.update(request_rate=request_rate, burstiness=burstiness)
    for i, r in enumerate(wl.requests):
        r.index = i
    return wl


def materialize_prompts(workload: Workload, vocab_size: int, seed: int,
                        reserved_ids: int = DEFAULT_RESERVED_IDS) -> None:
    """Fill prompt_token_ids in place. Block id b always yields the same block_tokens tokens
    (seeded by seed and b); the tail after the blocks is unique per request. Ids are drawn from
    [reserved_ids, vocab_size) so no special or eos token appears."""
    if vocab_size <= reserved_ids:
        raise ValueError(f"vocab_size must be > reserved_ids ({reserved_ids}), got {vocab_size}")
    block_cache: dict[int, list[int]] = {}

    def block_tokens(block_id: int) -> list[int]:
        if block_id not in block_cache:
            rng = random.Random(f"{seed}:block:{block_id}")
            block_cache[block_id] = [rng.randrange(reserved_ids, vocab_size) for _ in range(workload.block_tokens)]
        return block_cache[block_id]

    for r in workload.requests:
        ids: list[int] = []
        for b in r.prefix_blocks:
            ids.extend(block_tokens(b))
        ids = ids[: r.prompt_len]
        rng = random.Random(f"{seed}:req:{r.index}")
        ids.extend(rng.randrange(reserved_ids, vocab_size) for _ in range(r.prompt_len - len(ids)))
        r.prompt_token_ids = ids
