#!/usr/bin/env python3
"""A multi-node Ray cluster on one machine, one network namespace per host (needs root).

Three hosts on one bridge, every address inside namespaces this script makes (10.77.0.0/24 by
default) and nothing else:

    <prefix>-sw       the "switch": a namespace holding only the bridge br0 (no address)
    <prefix>-head     10.77.0.1  Ray head (GCS on :6379), resource {"node_head": 1}
    <prefix>-prefill  10.77.0.2  Ray worker node, resource {"node_prefill": 1}
    <prefix>-decode   10.77.0.3  Ray worker node, resource {"node_decode": 1}

One Ray CPU and one unit of its `node_<host>` resource per host by default (`cpus`, `units`);
a tensor-parallel worker needs one of each per rank on its host (its placement group's
bundles): give that host more, at `up` or when restarting it (`restart_ray(host, num_cpus=,
units=)`: Ray cannot change a live node's resources). A machine joining the running cluster is
`add_host(name, resources)` (the subnet's next address, e.g. 10.77.0.4, on the same bridge), and
`remove_host(name)` takes it away again (Ray then declares its node dead).

Each host's interface is `eth0` (a veth whose peer sits on the bridge); every Ray process is
started inside its host's namespace (`ip netns exec`), with its own --temp-dir. Deleting the
namespaces removes the veths and the bridge with them; processes are killed by namespace
(`ip netns pids`), so nothing survives `down()`.

Command line:

    scripts/netns_cluster.py up        # namespaces + Ray on all three hosts, prints the head address
    scripts/netns_cluster.py --cpus 1,2,1 --units 1,2,1 up   # the prefill host with room for 2 ranks
    scripts/netns_cluster.py exec head -- pdcluster serve --address 10.77.0.1:6379 ...
    scripts/netns_cluster.py kill decode   # everything in the decode host's namespace (raylet included)
    scripts/netns_cluster.py start decode  # `ray start` on it again
    scripts/netns_cluster.py down      # kill every process in the namespaces, delete them
"""
from __future__ import annotations

import argparse
import json
import secrets
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the repository's venv, or (a worktree without one) the venv of the interpreter running this
VENV_BIN = REPO / ".venv" / "bin" if (REPO / ".venv").exists() else Path(sys.executable).parent
GCS_PORT = 6379


@dataclass
class Host:
    name: str              # short name: head, prefill, decode
    ip: str
    resources: dict[str, float]
    num_cpus: int
    head: bool = False


@dataclass
class NetnsCluster:
    prefix: str = "pdmn"
    subnet: str = "10.77.0"            # /24; hosts get .1, .2, .3
    workdir: Path = field(default_factory=lambda: Path("/tmp/pdmn"))
    env: dict[str, str] = field(default_factory=dict)   # extra env for every Ray process (UCX_TLS, ...)
    cpus: tuple[int, int, int] = (1, 1, 1)              # Ray CPUs of head, prefill, decode
    units: tuple[int, int, int] = (1, 1, 1)             # units of each host's custom resource (node_<name>)
    object_store_bytes: int = 128 << 20
    hosts: list[Host] = field(default_factory=list)
    # Ray's failure detection (the GCS's health checks of each raylet, set on the head): a node
    # that stops answering is declared dead after about period * threshold (+ timeout) = ~3 s,
    # instead of Ray's default 3 s * 5 = ~15 s; its actors restart elsewhere (or wait for room)
    failure_detection: dict[str, int] = field(default_factory=lambda: {
        "health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
        "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3})
    # Ray's token authentication, with a token made for this cluster (never ~/.ray/auth_token):
    # every process of the cluster and every driver gets it through its environment
    auth_token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        if not self.hosts:
            self.hosts = [
                Host("head", f"{self.subnet}.1", {"node_head": self.units[0]}, self.cpus[0], head=True),
                Host("prefill", f"{self.subnet}.2", {"node_prefill": self.units[1]}, self.cpus[1]),
                Host("decode", f"{self.subnet}.3", {"node_decode": self.units[2]}, self.cpus[2]),
            ]

    # ---- names -----------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def head_address(self) -> str:
        return f"{self.host('head').ip}:{GCS_PORT}"

    def namespaces(self) -> list[str]:
        return [self.switch] + [self.ns(h.name) for h in self.hosts]

    # ---- network ---------------------------------------------------------------------------
    def up_network(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for i, h in enumerate(self.hosts, 1):
            self._plug(h, i)

    def _plug(self, h: Host, port: int) -> None:
        """The host's namespace, its eth0 on the bridge's port p<port>."""
        ns = self.ns(h.name)
        _ip("netns", "add", ns)
        # both ends are created directly inside their namespaces: nothing appears in the root one
        _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth",
            "peer", "name", f"p{port}", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", f"p{port}", "master", "br0")
        _ip("-n", self.switch, "link", "set", f"p{port}", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    # ---- processes -------------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        keep = ("HOME", "LANG", "LC_ALL", "TERM", "PDCLUSTER_CACHE", "TMPDIR")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env["PATH"] = f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env["PYTHONPATH"] = str(REPO)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["OMP_NUM_THREADS"] = "1"
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = self.auth_token
        env.update(self.env)
        return env

    def popen(self, host: str, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start argv inside the host's namespace (its own session, so a test can signal it)."""
        full = dict(self.base_env())
        full.update(env or {})
        return subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], env=full, cwd=REPO,
                                start_new_session=True, **kw)

    def run(self, host: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
        full = dict(self.base_env())
        full.update(env or {})
        return subprocess.run(["ip", "netns", "exec", self.ns(host), *argv], env=full, cwd=REPO, timeout=timeout,
                              check=check, capture_output=True, text=True)

    def temp_dir(self, host: str) -> Path:
        return self.workdir / f"ray-{host}"

    def start_ray(self, host: str, timeout: float = 180, *, num_cpus: int | None = None,
                  units: int | None = None) -> None:
        """`ray start` on the host. `num_cpus`/`units` (its Ray CPUs, the units of its custom
        resource `node_<name>`) reshape the host from this start on (a host brought back bigger,
        e.g. room for a tensor-parallel group's bundles); by default it keeps its shape."""
        h = self.host(host)
        if num_cpus is not None:
            h.num_cpus = num_cpus
        if units is not None:
            h.resources = {f"node_{h.name}": units}
        tmp = self.temp_dir(host)
        tmp.mkdir(parents=True, exist_ok=True)
        argv = [str(VENV_BIN / "ray"), "start", "--node-ip-address", h.ip, "--disable-usage-stats",
                "--temp-dir", str(tmp), "--num-cpus", str(h.num_cpus), "--num-gpus", "0",
                "--resources", json.dumps(h.resources), "--object-store-memory", str(self.object_store_bytes)]
        env = None
        if h.head:
            argv += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
            env = {f"RAY_{k}": str(v) for k, v in self.failure_detection.items()}
        else:
            argv += ["--address", self.head_address]
        for attempt in (1, 2):
            r = self.run(host, argv, env=env, timeout=timeout, check=False)
            if r.returncode == 0:
                return
            # `ray start` gives its raylet a fixed 30 s to register with the GCS; on a loaded
            # machine it may take longer: once, clear the host's processes and start it again
            if attempt == 1 and "timed out during startup" in r.stderr:
                self.kill(host)
                continue
            raise RuntimeError(f"ray start on {host} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")

    def up(self) -> None:
        """Network, then Ray on every host; on any failure everything made so far is removed."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.up_network()
            for h in self.hosts:
                self.start_ray(h.name)
            self.wait_nodes(len(self.hosts))
        except BaseException:
            self.down()
            raise

    def alive_nodes(self) -> list[dict]:
        """Ray's view of its nodes (asked from the head's namespace)."""
        code = ("import json, ray; ray.init(address='auto', log_to_driver=False); "
                "print('NODES ' + json.dumps([dict(ip=n['NodeManagerAddress'], alive=n['Alive'], res=n['Resources']) "
                "for n in ray.nodes()]))")
        r = self.run("head", [str(VENV_BIN / "python"), "-c", code],
                     env={"RAY_ADDRESS": self.head_address}, timeout=120)
        # Ray may print its own warnings to stdout (e.g. about a node it just lost)
        line = next(ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("NODES "))
        return [n for n in json.loads(line[len("NODES "):]) if n["alive"]]

    def wait_nodes(self, n: int, timeout: float = 120) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.alive_nodes()
            if len(nodes) >= n:
                return nodes
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} Ray nodes not alive within {timeout:.0f}s: {nodes}")
            time.sleep(0.5)

    def pids(self, host_or_ns: str) -> list[int]:
        ns = host_or_ns if host_or_ns.startswith(self.prefix + "-") else self.ns(host_or_ns)
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def kill(self, host_or_ns: str, timeout: float = 30) -> None:
        """SIGKILL every process in the namespace (a lost machine), until none is left."""
        deadline = time.monotonic() + timeout
        while pids := self.pids(host_or_ns):
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes left in {host_or_ns}: {pids}")
            time.sleep(0.05)

    def restart_ray(self, host: str, *, num_cpus: int | None = None, units: int | None = None,
                    timeout: float = 120) -> None:
        """Kill everything in a worker host's namespace, wait until Ray declares its node dead,
        then `ray start` it again (with another shape if `num_cpus`/`units` say so) and wait
        until it is alive with that shape. Ray cannot change a live node's resources."""
        h = self.host(host)
        assert not h.head, "the head cannot be restarted under a running cluster"
        self.kill(host)

        def until(done, what: str) -> None:
            deadline = time.monotonic() + timeout
            while not done(nodes := [n for n in self.alive_nodes() if n["ip"] == h.ip]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} within {timeout:.0f}s: {nodes}")
                time.sleep(0.5)

        until(lambda mine: not mine, f"Ray did not declare the {host} node dead")
        self.start_ray(host, num_cpus=num_cpus, units=units)
        until(lambda mine: bool(mine) and mine[0]["res"].get("CPU") == h.num_cpus
              and all(mine[0]["res"].get(k) == v for k, v in h.resources.items()),
              f"the {host} node not alive with CPU={h.num_cpus} {h.resources}")

    def add_host(self, name: str, resources: dict[str, float], num_cpus: int = 1,
                 timeout: float = 120) -> Host:
        """A machine joining the running cluster: a new namespace on the bridge (the next address
        of the subnet), `ray start` in it with these resources, and wait until Ray has the node.
        `remove_host` takes it away again (and `down` removes it with the rest)."""
        assert all(h.name != name for h in self.hosts), f"host {name} exists"
        last = max(int(h.ip.rsplit(".", 1)[1]) for h in self.hosts)
        h = Host(name, f"{self.subnet}.{last + 1}", dict(resources), num_cpus)
        self.hosts.append(h)
        try:
            self._plug(h, last + 1)
            # an earlier host of this address (added and removed before) may still be in the other
            # hosts' neighbour tables with its old veth's MAC: connects to the new one then time out
            for other in self.hosts:
                if other is not h:
                    subprocess.run(["ip", "-n", self.ns(other.name), "neigh", "flush", "to", h.ip],
                                   capture_output=True)
            self.start_ray(name)
            self.wait_nodes(len(self.hosts), timeout=timeout)
        except BaseException:
            self.remove_host(name)
            raise
        return h

    def remove_host(self, name: str, timeout: float = 120) -> None:
        """The machine leaves: every process in its namespace killed, the namespace (and its
        veth) deleted, and wait until Ray declares its node dead."""
        h = self.host(name)
        assert not h.head, "the head cannot be removed under a running cluster"
        if self.ns(name) in self.existing_namespaces():
            self.kill(name)
            _ip("netns", "delete", self.ns(name))
        self.hosts.remove(h)
        deadline = time.monotonic() + timeout
        while any(n["ip"] == h.ip for n in self.alive_nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray did not declare the {name} node ({h.ip}) dead within {timeout:.0f}s")
            time.sleep(0.5)

    def existing_namespaces(self) -> list[str]:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
        return [n for n in names if n.startswith(self.prefix + "-")]

    def down(self) -> None:
        """Kill every process in our namespaces, delete them (veths and bridge go with them),
        remove the Ray temp dirs. Safe to call twice and after a partial `up`."""
        errors = []
        for ns in self.existing_namespaces():
            try:
                self.kill(ns)
            except Exception as exc:
                errors.append(str(exc))
        for ns in self.existing_namespaces():
            r = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"ip netns delete {ns}: {r.stderr.strip()}")
        shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise RuntimeError("; ".join(errors))


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", default="pdmn")
    p.add_argument("--subnet", default="10.77.0")
    p.add_argument("--workdir", default="/tmp/pdmn")
    p.add_argument("--cpus", default="1,1,1", help="Ray CPUs of head,prefill,decode (default 1,1,1)")
    p.add_argument("--units", default="1,1,1",
                   help="units of the custom resource node_<host> of head,prefill,decode (default 1,1,1); "
                        "e.g. 1,2,1 gives the prefill host room for a TP=2 worker's two bundles with --cpus 1,2,1")
    p.add_argument("--env", action="append", default=["UCX_TLS=tcp"],
                   help="KEY=VALUE for every Ray process (default: UCX_TLS=tcp)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    sub.add_parser("status")
    k = sub.add_parser("kill")
    k.add_argument("host")
    s = sub.add_parser("start")
    s.add_argument("host")
    e = sub.add_parser("exec")
    e.add_argument("host")
    e.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    three = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    c = NetnsCluster(prefix=args.prefix, subnet=args.subnet, workdir=Path(args.workdir), env=env,
                     cpus=three(args.cpus), units=three(args.units))
    token = Path(args.workdir) / "auth_token"   # the cluster's Ray token, kept between invocations
    if args.cmd != "up" and token.exists():
        c.auth_token = token.read_text().strip()
    if args.cmd == "up":
        c.up()
        token.touch(mode=0o600)
        token.write_text(c.auth_token)
        print(c.head_address)
    elif args.cmd == "down":
        c.down()
    elif args.cmd == "status":
        print(json.dumps(c.alive_nodes(), indent=1))
    elif args.cmd == "kill":
        c.kill(args.host)
    elif args.cmd == "start":
        c.start_ray(args.host)
    elif args.cmd == "exec":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(["ip", "netns", "exec", c.ns(args.host), *cmd], env=c.base_env(), cwd=REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
