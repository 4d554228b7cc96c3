"""The `autoscale:` section of the cluster config (cluster/config.py): the SLA planner's pools,
objective, loops and simulator floor (cluster/autoscale.py reads it)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from cluster.config_base import Strict as _Strict


class AutoscalePool(_Strict):
    min_replicas: int = Field(1, ge=1, le=16, description="fewest serving workers the planner leaves the pool "
                                                          "(where it goes at zero traffic)")
    max_replicas: int = Field(2, ge=1, le=16, description="most serving workers the planner gives the pool (the "
                                                          "Scale RPC's limit is 16); at least min_replicas")


class SloSettings(_Strict):
    ttft_s: float = Field(2.0, gt=0, le=600, description="time to first token the planner holds the pools to, "
                                                         "in seconds, at `percentile`")
    itl_s: float = Field(0.2, gt=0, le=60, description="gap between consecutive streamed chunks (inter-token "
                                                       "latency) the planner holds the pools to, in seconds, at "
                                                       "`percentile`")
    percentile: float = Field(90.0, gt=0, lt=100, description="the percentile of the window's TTFT and ITL "
                                                              "compared with the SLO, e.g. 90 or 99")


class AutoscaleSettings(_Strict):
    mode: Literal["off", "advisory", "on"] = Field(
        "off", description="off: no planner; advisory: the planner decides and logs (and sets "
                           "pdcluster_autoscale_desired_replicas) but changes no target; on: it sets the pools' "
                           "targets as the Scale RPC does, and the cluster's scaler resizes them")
    pools: dict[str, AutoscalePool] = Field(default_factory=dict,
                                            description="the pools the planner resizes, by pool name, with their "
                                                        "min_replicas and max_replicas; a pool not named here keeps "
                                                        "its replicas")
    slo: SloSettings = Field(default_factory=SloSettings, description="the latency objective of the fast loop")
    budget_cpus: float | None = Field(None, gt=0, description="most Ray CPUs all pools' workers may reserve "
                                                              "together (replicas and hot spares, every "
                                                              "tensor-parallel rank); a scale-out past it is not "
                                                              "made; null: no budget")
    interval_s: float = Field(2.0, ge=0.2, le=5.0, description="period of the fast loop: each pool's TTFT and ITL "
                                                               "estimated, at most one replica up or down")
    window_s: float = Field(30.0, ge=1, le=600, description="the fast loop's TTFT and ITL percentiles are over "
                                                            "the router's requests of this many last seconds")
    up_cooldown_s: float = Field(15.0, ge=0, le=3600, description="a pool is scaled out no sooner than this "
                                                                  "after its last change")
    down_cooldown_s: float = Field(120.0, ge=0, le=3600, description="a pool is scaled in no sooner than this "
                                                                     "after its last change")
    down_fraction: float = Field(0.5, gt=0, lt=1, description="a pool is scaled in only when its estimates, "
                                                              "scaled to one replica fewer, stay under this "
                                                              "fraction of the SLO")
    kv_high: float = Field(0.9, gt=0, le=1, description="a pool whose workers' KV pages in use reach this "
                                                        "fraction (their mean) is scaled out")
    queue_high: float = Field(4.0, gt=0, le=100000, description="a pool whose requests waiting (not in the "
                                                                "batch) per serving worker reach this is scaled out")
    slow_interval_s: float = Field(120.0, ge=10, le=3600,
                                   description="period and window of the slow loop: arrival rate, prompt and "
                                               "output lengths and time in the system over this window give "
                                               "each pool a floor of replicas (`floor`, docs/operations.md)")
    floor: Literal["littles_law", "simulator"] = Field(
        "littles_law", description="how the slow loop sets each pool's floor: littles_law (the requests in the "
                                   "system over what a replica's batch holds), or simulator (planning's simulator, "
                                   "in a process of its own, replays a workload drawn from the window's arrival "
                                   "rate, lengths and prefix hits on the profile's step times; the smallest replica "
                                   "counts that hold the SLO are the floors; needs `profile`; where an evaluation "
                                   "fails or times out, Little's law's floors apply, logged)")
    profile: str | None = Field(None, description="with floor simulator: a profile JSON of the step times of the "
                                                  "pools' hardware, as `pdcluster plan profile` writes it (or a "
                                                  "bare LatencyModel JSON); read where the config is loaded and "
                                                  "carried to router 0; null: none (floor simulator refused)")
    floor_budget_s: float = Field(2.0, ge=0.1, le=60,
                                  description="the simulator floor's search starts no candidate replica count after "
                                              "this many seconds (a search cut short returns the next count it "
                                              "would have tried: a lower bound)")
    floor_timeout_s: float = Field(20.0, ge=1, le=600,
                                   description="the simulator floor's process is killed after this many seconds and "
                                               "Little's law's floor is used; with floor simulator, above "
                                               "floor_budget_s and below slow_interval_s (one evaluation at a time)")
    _profile_json: dict | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _floor_has_a_profile(self) -> AutoscaleSettings:
        if self.profile is not None:
            self._profile_json = _read_profile(self.profile)
        if self.floor == "simulator" and self.profile is None:
            raise ValueError("autoscale.profile is required by autoscale.floor: simulator (a profile JSON from "
                             "`pdcluster plan profile`), got null")
        if self.floor == "simulator" and not self.floor_budget_s < self.floor_timeout_s < self.slow_interval_s:
            raise ValueError(f"autoscale.floor_timeout_s must be in (floor_budget_s {self.floor_budget_s:g}, "
                             f"slow_interval_s {self.slow_interval_s:g}), got {self.floor_timeout_s:g}")
        return self

    @property
    def profile_json(self) -> dict | None:
        """The profile's content, read when the config was validated (it travels with the config)."""
        return self._profile_json


def _read_profile(path: str) -> dict:
    """The profile JSON at `path`, checked for the step-time fields planning.latency.LatencyModel needs."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"autoscale.profile: cannot read {path!r} as JSON: {exc}") from None
    lm = data.get("latency_model", data) if isinstance(data, dict) else None
    ok = (isinstance(lm, dict) and isinstance(lm.get("prefill"), list) and len(lm["prefill"]) == 4
          and isinstance(lm.get("decode"), list) and len(lm["decode"]) == 3)
    if not ok:
        raise ValueError(f"autoscale.profile: {path!r} is not a profile: expected `pdcluster plan profile`'s JSON "
                         f"(a latency_model with prefill [4 numbers] and decode [3 numbers])")
    return data
