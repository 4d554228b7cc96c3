"""The `pdcluster` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; heavy imports stay inside `run`."""
from __future__ import annotations

import argparse
import importlib
import sys

# (group, name) -> module; group None means a top-level command.
_COMMANDS: dict[tuple[str | None, str], tuple[str, str]] = {
    (None, "demo"): ("cluster.demo", "generate text from a built-in model and print timings"),
    (None, "demo-cluster"): ("cluster.demo_cluster", "serve the embedded default cluster, run concurrent streams, stop"),
    (None, "serve"): ("cluster.serve", "start the cluster (router + prefill/decode pools on Ray) and serve gRPC"),
    (None, "generate"): ("cluster.generate", "stream one answer from a running cluster"),
    (None, "status"): ("cluster.status", "pools, workers, load and KV usage of a running cluster"),
    (None, "scale"): ("cluster.scale", "resize a pool of a running cluster: workers start, or drain and stop"),
    (None, "drain"): ("cluster.drain", "take a running router out of service: running requests finish, new ones are refused"),
    ("model", "make-tiny"): ("engine.builtin.cli", "write a deterministic built-in HF checkpoint"),
    ("model", "import-gguf"): ("engine.gguf_import", "a GGUF file into an HF checkpoint folder (float safetensors)"),
    ("model", "fetch"): ("cluster.model_fetch", "download a real trained model (smollm2) into the cache"),
    ("bench", "engine"): ("bench.engine_bench", "engine vs transformers: throughput, decode step, prefill"),
    ("bench", "decode-step"): ("bench.decode_step_bench", "decode step: the compiled CPU attention kernel vs the torch backend"),
    ("bench", "kv"): ("bench.kv_bench", "KV transfer bandwidth: nixl, grpc vs memcpy/raw baselines"),
    ("bench", "tp"): ("bench.tp_bench", "tensor parallelism: engine TP=2 vs TP=1, KV bandwidth between TP groups"),
    ("bench", "workers"): ("bench.workers_bench", "prefill + decode workers vs colocated: second-token latency, ITL"),
    ("bench", "serve"): ("bench.serve_cli", "load a running endpoint with a workload: TTFT, TPOT, ITL, goodput"),
    ("bench", "disagg-vs-colocated"): ("bench.disagg_vs_colocated", "the experiment: 1P+1D vs 2 colocated on a trace"),
    ("bench", "chaos"): ("bench.chaos", "faults against a local cluster: fuzz, cancels, overload, kill -9"),
    ("bench", "multiturn"): ("bench.multiturn_bench", "multi-turn chats: per-turn TTFT and prefix hit rate, disagg vs colocated"),
    ("bench", "autoscale"): ("bench.autoscale_bench", "elastic pool vs static 1 and 2 replicas on a burst: SLO attainment, worker-s"),
    ("plan", "profile"): ("planning.profile_cli", "profile the real engine here and fit a latency model"),
    ("plan", "simulate"): ("planning.simulate_cli", "discrete-event simulation of a cluster config on a workload"),
    ("plan", "search"): ("planning.search_cli", "search pool configurations under SLOs and a hardware budget"),
    ("plan", "validate"): ("planning.validate_cli", "profile, simulate, run the real cluster, compare"),
}
_GROUPS = {"model": "models: built-in, imported from GGUF, fetched", "plan": "capacity planning: profile, simulate, search, validate",
           "bench": "benchmarks (not tests): ratios against same-run baselines"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for (group, name), (module_name, help_text) in _COMMANDS.items():
        if group is None:
            sub = top.add_parser(name, help=help_text)
        else:
            if group not in groups:
                gp = top.add_parser(group, help=_GROUPS[group])
                groups[group] = gp.add_subparsers(dest="subcommand", required=True)
            sub = groups[group].add_parser(name, help=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a command whose module is not built yet
            if not exc.name or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise
            sub.set_defaults(_run=lambda args, m=module_name: _missing(m))
            continue
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def _missing(module_name: str) -> int:
    print(f"pdcluster: this command is not available in this build ({module_name} missing)", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
