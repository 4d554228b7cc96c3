"""KV bandwidth between tensor-parallel groups: a prefill group of P ranks sends one request's KV
to a decode group of D ranks, for P:D of 1:1, 2:1 and 1:2, over nixl and grpc (issue 35, item 7).
Part of `pdcluster bench tp`; alone: `python -m bench.kv_tp_bench`.

Every rank is its own process (multiprocessing spawn), as real TP ranks are: its own KVPool with
its head range (kv_transfer.reshard.group_layouts), its own sender or receiver
(kv_transfer.registry) with its own NIXL agent or gRPC endpoint on 127.0.0.1. The routes are
kv_transfer.reshard.plan_transfer's: sender rank i starts the request with the descriptors of the
receiver ranks it sends to, and all rank pairs move in parallel. The rank processes for every
pairing are up at once (TP=1 and TP=2 senders, TP=1 and TP=2 receivers), so each round samples
every (pairing, transport) in turns and a burst of load on the shared machine hits a pairing and
its 1:1 baseline alike.

A sample is timed from "send" posted to every sender rank (all layers, then finish) until every
receiver rank reports DONE. GB/s is the model's KV of the request (every head once, whatever the
pairing) over that time: the same payload in every pairing, so GB/s ratios are time ratios. Wire
bytes can be more: a route between different head ranges moves the sender's whole pages (nixl
reads them into the receiver's staging buffer; grpc sends the sender's heads), so with 1:2 each
receiver rank gets all of the sender's heads and keeps half (`wire_bytes`).

Correctness: every sender rank fills its pages with a pattern of (layer, page, K/V, slot, global
head, dim); before each (pairing, transport)'s untimed warm-up transfer the receivers zero their
pools, after it each compares its pages with the pattern of its own heads (exact) and reports a
checksum. Figures are medians over `--kv-repeats` rounds; ratios to 1:1 are medians of per-round
pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

PAIRINGS = ("1:1", "2:1", "1:2")
SHAPES = {
    # name: (layers, kv heads, head dim, dtype); llama8b = Llama-3-8B's KV, as `bench kv` uses
    "llama8b": (32, 8, 128, "bfloat16"),
    # the built-in `small` preset (6 layers, 4 kv heads, head dim 32) as the engine runs it
    "small": (6, 4, 32, "float32"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV options (shared by `bench tp`); None = the default or its --quick value."""
    parser.add_argument("--kv-shape", choices=sorted(SHAPES), default="llama8b",
                        help="KV shape: llama8b (32 layers, 8 kv heads, dim 128, bf16; default) or small")
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="prompt tokens of the request moved (default 2048: 256 MiB of llama8b; --quick 512)")
    parser.add_argument("--kv-repeats", type=int, default=None, help="timed rounds (default 5; --quick 2)")
    parser.add_argument("--kv-transports", default="nixl,grpc", help="comma-separated (default nixl,grpc)")
    parser.add_argument("--kv-pairings", default=",".join(PAIRINGS),
                        help="P:D pairings, comma-separated (default 1:1,2:1,1:2; 1:1 is the baseline)")
    parser.add_argument("--page-size", type=int, default=16)


def resolve(args: argparse.Namespace) -> None:
    quick = getattr(args, "quick", False)
    if args.kv_tokens is None:
        args.kv_tokens = 512 if quick else 2048
    if args.kv_repeats is None:
        args.kv_repeats = 2 if quick else 5


# ------------------------------------------------------------------------------- rank side --
def pattern(layout, num_pages: int, layer: int):
    """int16 [num_pages, 2, page, heads, dim]: the bits every sender writes, by global head, so
    replicas hold the same and a receiver can rebuild what its own heads must hold."""
    import torch

    def ax(n: int, pos: int, mul: int, start: int = 0):
        shape = [1] * 5
        shape[pos] = n
        return (torch.arange(start, start + n, dtype=torch.int64) * mul).view(shape)

    v = (ax(num_pages, 0, 7919) + ax(2, 1, 104729) + ax(layout.page_size, 2, 31)
         + ax(layout.num_heads, 3, 65537, layout.head_start) + ax(layout.head_dim, 4, 3) + layer * 999983)
    return (v % 32000).to(torch.int16)  # below bf16's inf/NaN bit patterns


def _rank_main(conn, spec_kw: dict, layout_kw: dict, num_pages: int) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from kv_transfer.config import TransferConfig
    from kv_transfer.descriptor import DestinationDescriptor
    from kv_transfer.layout import KVLayout, KVPool, ModelSpec
    from kv_transfer.registry import create_receiver, create_sender

    layout = KVLayout(**layout_kw)
    pool = KVPool.allocate(ModelSpec(**spec_kw), layout, num_pages)
    objs: dict = {}
    ints = {2: torch.int16, 4: torch.int32}[pool.layers[0].element_size()]  # the pattern goes in as bits
    conn.send("ready")
    while True:
        cmd, *a = conn.recv()
        try:
            if cmd == "exit":
                break
            if cmd == "fill":
                for i, t in enumerate(pool.layers):
                    t.view(ints).copy_(pattern(layout, num_pages, i))
                reply = True
            elif cmd == "zero":
                for t in pool.layers:
                    t.zero_()
                reply = True
            elif cmd == "verify":
                (n,) = a
                bad, checksum = [], 0
                for i, t in enumerate(pool.layers):
                    got = t[:n].view(ints)
                    if not torch.equal(got, pattern(layout, num_pages, i)[:n].to(ints)):
                        bad.append(i)
                    checksum += int(got.to(torch.int64).sum())
                reply = {"ok": not bad, "bad_layers": bad, "checksum": checksum}
            elif cmd == "receiver":
                t, cfg = a
                objs[t] = create_receiver(t, pool, TransferConfig(**cfg))
                reply = objs[t].endpoint
            elif cmd == "sender":
                t, cfg = a
                objs[t] = create_sender(t, pool, TransferConfig(**cfg))
                reply = True
            elif cmd == "expect":
                t, rid, pages, tokens = a
                reply = objs[t].expect(rid, pages, tokens, deadline_s=300).to_bytes()
            elif cmd == "start":
                t, rid, descs, pages, tokens = a
                reply = objs[t].start(rid, [DestinationDescriptor.from_bytes(d) for d in descs], pages,
                                      tokens).state.name
            elif cmd == "send":
                t, rid = a
                s = objs[t]
                for layer in range(layout.num_layers):
                    s.send_layer(rid, layer)
                s.finish(rid, 1, 0)
                st = s.wait(rid, 300)
                reply = (st.state.name, st.error)
            elif cmd == "wait":
                t, rid = a
                st = objs[t].wait(rid, 300)
                objs[t].take(rid)
                reply = (st.state.name, st.error)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", reply))
        except Exception as exc:  # the coordinator stops the run with it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    for o in objs.values():
        o.close()
    conn.send(("ok", "bye"))


# -------------------------------------------------------------------------- coordinator side --
class Rank:
    def __init__(self, ctx, name: str, spec_kw: dict, layout, num_pages: int) -> None:
        from dataclasses import asdict

        self.name, self.layout = name, layout
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child, spec_kw, asdict(layout), num_pages), daemon=True,
                                name=name)
        self.proc.start()

    def ready(self, timeout: float = 180) -> None:
        if not self.conn.poll(timeout) or self.conn.recv() != "ready":
            raise RuntimeError(f"rank {self.name} did not start")

    def post(self, *cmd) -> None:
        self.conn.send(cmd)

    def read(self, timeout: float = 600):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank {self.name}: no reply in {timeout} s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"rank {self.name}: {value}")
        return value

    def call(self, *cmd, timeout: float = 600):
        self.post(*cmd)
        return self.read(timeout)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=30)
        except Exception:
            pass
        self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def _parse_pairings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        p, d = item.strip().split(":")
        out.append((int(p), int(d)))
    if (1, 1) not in out:
        out.insert(0, (1, 1))  # the baseline
    return out


def run_kv(args: argparse.Namespace) -> dict:
    """Measure; returns the JSON-able result (also printed)."""
    import multiprocessing as mp

    from kv_transfer.reshard import group_layouts, plan_transfer

    resolve(args)
    layers, heads, head_dim, dtype = SHAPES[args.kv_shape]
    pairings = _parse_pairings(args.kv_pairings)
    transports = [t.strip() for t in args.kv_transports.split(",") if t.strip()]
    tokens, repeats = args.kv_tokens, max(1, args.kv_repeats)
    lay_kw = dict(num_layers=layers, page_size=args.page_size, head_dim=head_dim, dtype=dtype)
    groups = {n: group_layouts(heads, n, **lay_kw) for n in sorted({x for pd in pairings for x in pd})}
    full = group_layouts(heads, 1, **lay_kw)[0]
    num_pages = full.pages_for(tokens)
    payload = num_pages * full.page_bytes * layers
    spec_kw = dict(model_id=f"kv-tp-{args.kv_shape}", num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
    print(f"KV between TP groups: {args.kv_shape} ({layers} layers, {heads} kv heads, dim {head_dim}, {dtype}), "
          f"{tokens} tokens = {payload / 2**20:.0f} MiB, pairings {', '.join(f'{p}:{d}' for p, d in pairings)}, "
          f"{', '.join(transports)}, {repeats} rounds, one process per rank, 127.0.0.1", flush=True)
    ctx = mp.get_context("spawn")
    senders = {n: [] for n in {p for p, _ in pairings}}
    receivers = {n: [] for n in {d for _, d in pairings}}
    ranks: list[Rank] = []
    samples: dict[str, list[float]] = {}
    checks: dict[str, dict] = {}
    plans = {}
    try:
        for side, book in (("send", senders), ("recv", receivers)):
            for n in sorted(book):
                for r, lay in enumerate(groups[n]):
                    rank = Rank(ctx, f"{side}-tp{n}-r{r}", spec_kw, lay, num_pages)
                    book[n].append(rank)
                    ranks.append(rank)
        for rank in ranks:
            rank.ready()
        for n in senders:
            for rank in senders[n]:
                rank.call("fill")
        for t in transports:
            for rank in ranks:
                if rank.name.startswith("send"):
                    rank.call("sender", t, {"host": "127.0.0.1"})
                else:
                    rank.call("receiver", t, {"host": "127.0.0.1"})
        pages = list(range(num_pages))
        counter = [0]

        def transfer(p: int, d: int, t: str) -> float:
            rid = f"{t}-{p}to{d}-{counter[0]}"
            counter[0] += 1
            snd, rcv = senders[p], receivers[d]
            plan = plans[(p, d)]
            descs = [r.call("expect", t, rid, pages, tokens) for r in rcv]
            active = []
            for i, s in enumerate(snd):
                dests = [descs[j] for j in plan.receivers_of(i)]
                if dests:
                    state = s.call("start", t, rid, dests, pages, tokens)
                    if state != "WAITING":
                        raise RuntimeError(f"{rid}: sender rank {i} start ended {state}")
                    active.append(s)
            for r in rcv:
                r.post("wait", t, rid)
            time.sleep(0.05)  # the receivers are in wait() before the first byte moves
            t0 = time.perf_counter()
            for s in active:
                s.post("send", t, rid)
            results = [r.read() for r in rcv]
            elapsed = time.perf_counter() - t0
            results += [s.read() for s in active]
            for state, error in results:
                if state != "DONE":
                    raise RuntimeError(f"{rid}: a rank ended {state}: {error}")
            return elapsed

        wire = {}
        for p, d in pairings:
            plan = plans[(p, d)] = plan_transfer(groups[p], groups[d])
            wire[f"{p}:{d}"] = sum(groups[p][r.sender].page_bytes for r in plan.routes) * num_pages * layers
        combos = [(p, d, t) for t in transports for p, d in pairings]
        for p, d, t in combos:  # warm-up: connections, page faults; and the correctness check
            for r in receivers[d]:
                r.call("zero")
            transfer(p, d, t)
            res = [r.call("verify", num_pages) for r in receivers[d]]
            key = f"{t} {p}:{d}"
            checks[key] = {"ok": all(x["ok"] for x in res), "checksums": [x["checksum"] for x in res],
                           "bad_layers": [x["bad_layers"] for x in res]}
            if not checks[key]["ok"]:
                raise RuntimeError(f"{key}: the receiver pages differ from the sender's heads: {checks[key]}")
        for rnd in range(repeats):
            for p, d, t in (combos if rnd % 2 == 0 else combos[::-1]):
                samples.setdefault(f"{t} {p}:{d}", []).append(transfer(p, d, t))
            print(f"  round {rnd + 1}: " + ", ".join(f"{k} {payload / v[-1] / 1e9:.2f}" for k, v in samples.items())
                  + " GB/s", flush=True)
    finally:
        for rank in ranks:
            rank.close()
    table = {}
    for t in transports:
        base = samples[f"{t} 1:1"]
        for p, d in pairings:
            key = f"{t} {p}:{d}"
            xs = samples[key]
            table[key] = {"transport": t, "pairing": f"{p}:{d}", "gbps": payload / statistics.median(xs) / 1e9,
                          "vs_1to1": statistics.median(b / x for b, x in zip(base, xs)),
                          "routes": [[r.sender, r.receiver, r.head_start, r.num_heads] for r in plans[(p, d)].routes],
                          "wire_bytes": wire[f"{p}:{d}"], "verified": checks[key]["ok"],
                          "checksums": checks[key]["checksums"]}
    print(f"| transport | P:D | routes | GB/s (median of {repeats}) | / 1:1 (same run) | wire bytes / payload | verified |")
    print("|---|---|---|---|---|---|---|")
    for key, row in table.items():
        print(f"| {row['transport']} | {row['pairing']} | {len(row['routes'])} | {row['gbps']:.2f} | "
              f"{row['vs_1to1']:.2f} | {row['wire_bytes'] / payload:.1f} | {'yes' if row['verified'] else 'NO'} |")
    return {"shape": args.kv_shape, "layers": layers, "kv_heads": heads, "head_dim": head_dim, "dtype": dtype,
            "tokens": tokens, "payload_bytes": payload, "repeats": repeats, "table": table, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_tp_bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = parser.parse_args(argv)
    res = run_kv(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "kv_tp", **res}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
