"""Benchmark output: a fixed-layout text table, a JSON file with every figure and per-request
record, and PNG plots (matplotlib, Agg backend, imported only when plots are asked for)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from loadgen.metrics import METRICS, RequestRecord

_W = 50


def _line(label: str, value) -> str:
    text = "n/a" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
    return f"{label:<{_W - 12}}{text:>12}"


def format_table(summary: dict) -> str:
    rows = ["{:=^{w}}".format(" Serving Benchmark Result ", w=_W),
            _line("Successful requests:", summary["completed"]),
            _line("Failed requests:", summary["failed"]),
            _line("Benchmark duration (s):", summary["duration_s"]),
            _line("Total input tokens:", summary["total_input_tokens"]),
            _line("Total generated tokens:", summary["total_output_tokens"]),
            _line("Cached prompt tokens:", summary["cached_tokens"]),
            _line("Request throughput (req/s):", summary["request_throughput"]),
            _line("Output token throughput (tok/s):", summary["output_throughput"]),
            _line("Total token throughput (tok/s):", summary["total_token_throughput"])]
    if "goodput" in summary:
        slo = " ".join(f"{k}:{v:g}" for k, v in summary["slo_ms"].items())
        rows += [_line(f"Goodput (req/s) [{slo}]:", summary["goodput"]),
                 _line("Good fraction:", summary["good_fraction"])]
    for err, n in sorted(summary["errors"].items()):
        rows.append(_line(f"  error {err}:", n))
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    for m in METRICS:
        stats = summary[f"{m}_ms"]
        rows.append("{:-^{w}}".format(titles[m], w=_W))
        rows += [_line(f"Mean {m.upper()} (ms):", stats["mean"]), _line(f"Median {m.upper()} (ms):", stats["median"]),
                 _line(f"Std {m.upper()} (ms):", stats["std"])]
        rows += [_line(f"P{q:g} {m.upper()} (ms):", stats[f"p{q:g}"]) for q in summary["percentiles"]]
    rows.append("=" * _W)
    return "\n".join(rows)


def write_json(path: str | Path, summary: dict, records: list[RequestRecord], config: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "summary": summary, "requests": [asdict(r) for r in records]}
    Path(path).write_text(json.dumps(doc, indent=1))


def write_plots(directory: str | Path, records: list[RequestRecord], timeline) -> list[Path]:
    """TTFT CDF, ITL CDF, output tokens/s per second of the run, queue depth; returns the PNGs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)

    for name, values in (("ttft_cdf.png", [r.ttft_s * 1e3 for r in done]),
                         ("itl_cdf.png", [g * 1e3 for r in done for g in r.itls_s])):
        fig, ax = plt.subplots(figsize=(6, 4))
        vals = sorted(values)
        ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
        ax.set_xlabel(f"{name.split('_')[0].upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        save(fig, name)

    token_times = sorted(r.start_s + t for r in done for t in r.chunk_times_s)
    fig, ax = plt.subplots(figsize=(6, 4))
    if token_times:
        bins = max(1, int(token_times[-1]) + 1)
        ax.hist(token_times, bins=bins, range=(0, bins))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("chunks received per second")
    save(fig, "throughput_over_time.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ts = [s[0] for s in timeline.samples]
    ax.step(ts, [s[1] for s in timeline.samples], where="post", label="in flight")
    ax.step(ts, [s[2] for s in timeline.samples], where="post", label="waiting for concurrency")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests")
    ax.legend()
    save(fig, "queue_depth.png")
    return paths
