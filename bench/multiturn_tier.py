"""The KV store tier in `pdcluster bench multiturn` (issue 37): store sizes to run the
disaggregated arm with, what router 0's /metrics says the tier did during an arm's measured
rounds, and the ratios between store sizes.

    --kv-store-size 0,auto    the disaggregated arm once per size, labelled `disaggregated store=0`
                              (tier off), `disaggregated store=auto`, ...; the colocated arm has
                              no store (its workers have no KV connector) and runs once

Per arm it scrapes router 0's metrics after the warm-up and again after the rounds (a short
settle first: offloads run in the background after a request ends, and the store gauges come
from the router's last load call), and reports the counters' differences: prompt tokens fetched
instead of computed by source (a node's store or a worker), fetches that fell back to computing,
offloads into the stores and their tokens; and the gauges at the end: each store's hit rate
(tokens it sent over tokens asked of it, since it started: the warm-up included), its pages, and
the block hashes the router's KV index holds per worker and store (what each cache holds then).
"""
from __future__ import annotations

import time
import urllib.request

SETTLE_S = 2.0   # after the last round: background offloads finish, the router refreshes the stores' loads


def parse_store_sizes(text: str) -> list[str]:
    """The comma list of --kv-store-size, each a kv_store.size ('auto', 0, 16MiB, ...), distinct."""
    from cluster.config_kv_store import SIZE_FORMS, parse_size

    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise SystemExit(f"--kv-store-size must list sizes ({SIZE_FORMS}), got {text!r}")
    seen = set()
    for s in items:
        try:
            b = parse_size(s, "--kv-store-size")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        key = "auto" if b is None else b
        if key in seen:
            raise SystemExit(f"--kv-store-size lists the same size twice: {text!r}")
        seen.add(key)
    return items


def is_off(size: str | None) -> bool:
    from cluster.config_kv_store import parse_size

    return size is not None and parse_size(size) == 0


def label(arm: str, store: str | None) -> str:
    return arm if store is None else f"{arm} store={store}"


def scrape(url: str, timeout_s: float = 10.0) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} of a Prometheus endpoint; {} when there is none
    or it does not answer (the figures are then missing, the run goes on)."""
    if not url:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _by(samples: dict, name: str, key: str) -> dict[str, float]:
    return {dict(lv)[key]: v for (n, lv), v in samples.items() if n == name and key in dict(lv)}


def _one(samples: dict, name: str) -> float:
    return samples.get((name, ()), 0.0)


def figures(before: dict, after: dict) -> dict:
    """What the tier did between two scrapes (module docstring); None-free, ints where counts."""
    def delta_by(name: str, key: str) -> dict[str, int]:
        a, b = _by(after, name, key), _by(before, name, key)
        return {k: int(v - b.get(k, 0.0)) for k, v in sorted(a.items())}

    pages: dict[str, dict[str, int]] = {}
    for (n, lv), v in after.items():
        if n == "pdcluster_kv_store_pages":
            d = dict(lv)
            pages.setdefault(d["store"], {})[d["kind"]] = int(v)
    return {"scraped": bool(after),
            "fetches": delta_by("pdcluster_kv_fetches_total", "outcome"),
            "fetched_tokens": int(_one(after, "pdcluster_kv_fetched_tokens_total")
                                  - _one(before, "pdcluster_kv_fetched_tokens_total")),
            "fetched_tokens_by_source": delta_by("pdcluster_kv_fetched_tokens_by_source_total", "source"),
            "offloads": delta_by("pdcluster_kv_store_offloads_total", "outcome"),
            "offloaded_tokens": int(_one(after, "pdcluster_kv_store_offloaded_tokens_total")
                                    - _one(before, "pdcluster_kv_store_offloaded_tokens_total")),
            "store_hit_rate": _by(after, "pdcluster_kv_store_hit_rate", "store"),
            "store_pages": pages,
            "indexed_blocks": {k: int(v) for k, v in _by(after, "pdcluster_kv_index_worker_blocks", "worker").items()}}


def measured(url: str, play) -> tuple[object, dict]:
    """Run `play()` between two scrapes of `url`: (its result, figures)."""
    before = scrape(url)
    result = play()
    time.sleep(SETTLE_S)
    return result, figures(before, scrape(url))


def ratios(entries: list[dict], policies: tuple[str, ...], target: float) -> dict:
    """Per policy and store size: later turns' TTFT p50/p90 disaggregated / colocated (and whether
    the p50 meets `target`), and tier on / tier off (each size against size 0) for TTFT and hit
    rate; entries of one run."""
    def div(a, b):
        return a / b if a is not None and b else None

    out: dict = {}
    for policy in policies:
        coloc = next((e for e in entries if e["arm"] == "colocated" and e["policy"] == policy), None)
        disagg = [e for e in entries if e["arm"] == "disaggregated" and e["policy"] == policy and "store" in e]
        off = next((e for e in disagg if is_off(e["store"])), None)
        for d in disagg:
            s, lt = d["store"], d["later_turns"]
            if coloc is not None:
                c = coloc["later_turns"]
                r = div(lt["ttft_p50_ms"], c["ttft_p50_ms"])
                out[f"disagg_over_colocated[{policy} store={s}]"] = {
                    "later_turns_ttft_p50": r, "later_turns_ttft_p90": div(lt["ttft_p90_ms"], c["ttft_p90_ms"]),
                    "per_turn_ttft_p50": {k: div(v["ttft_p50_ms"], coloc["per_turn"].get(k, {}).get("ttft_p50_ms"))
                                          for k, v in d["per_turn"].items()},
                    "target_met": None if r is None else r <= target}
            if off is not None and d is not off:
                o = off["later_turns"]
                out[f"tier_on_over_off[{policy} store={s}]"] = {
                    "later_turns_ttft_p50": div(lt["ttft_p50_ms"], o["ttft_p50_ms"]),
                    "later_turns_ttft_p90": div(lt["ttft_p90_ms"], o["ttft_p90_ms"]),
                    "later_turns_hit_rate": div(lt["hit_rate"], o["hit_rate"])}
    return out


def table(entries: list[dict]) -> str:
    """One row per arm: the tier's figures during its rounds."""
    rows = [["arm", "policy", "fetched store", "fetched worker", "fetches ok/recomputed", "offloads stored/skipped/failed",
             "offloaded tokens", "store hit rate", "store pages free/total", "indexed blocks"]]
    for e in entries:
        f = e.get("tier") or {}
        if not f.get("scraped"):
            rows.append([e.get("label", e["arm"]), e["policy"]] + ["-"] * 8)
            continue
        src, fe, off = f["fetched_tokens_by_source"], f["fetches"], f["offloads"]
        hit = ", ".join(f"{v:.0%}" for v in f["store_hit_rate"].values()) or "-"
        pages = ", ".join(f"{p.get('free', 0)}/{p.get('total', 0)}" for p in f["store_pages"].values()) or "-"
        blocks = ", ".join(f"{k}={v}" for k, v in f["indexed_blocks"].items()) or "-"
        rows.append([e.get("label", e["arm"]), e["policy"], str(src.get("store", 0)), str(src.get("worker", 0)),
                     f"{fe.get('fetched', 0)}/{fe.get('recomputed', 0)}",
                     f"{off.get('stored', 0)}/{off.get('skipped', 0)}/{off.get('failed', 0)}" if off else "-",
                     str(f["offloaded_tokens"]), hit, pages, blocks])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def summary_lines(r: dict, target: float) -> list[str]:
    """The headline ratios, one line each."""
    out = []
    for k, v in r.items():
        if k.startswith("disagg_over_colocated[") and "store=" in k:
            p50 = v["later_turns_ttft_p50"]
            verdict = "-" if v["target_met"] is None else ("met" if v["target_met"] else "missed")
            out.append(f"turns 2..: TTFT p50 disaggregated/colocated {k[k.index('[') + 1:-1]}: "
                       f"{'-' if p50 is None else f'{p50:.2f}x'} (target <= {target}x: {verdict}); "
                       f"p90 {_x(v['later_turns_ttft_p90'])}")
        elif k.startswith("tier_on_over_off["):
            out.append(f"turns 2..: tier on/off {k[k.index('[') + 1:-1]}: TTFT p50 {_x(v['later_turns_ttft_p50'])}, "
                       f"p90 {_x(v['later_turns_ttft_p90'])}, hit rate {_x(v['later_turns_hit_rate'])}")
    return out


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"
