"""What a cluster process knows about the node it runs on: its address (where the other nodes
reach it), the address its listeners bind, UCX's network device, and its scheduling priority.
Used by the worker actors (cluster.actors) and the tensor-parallel follower actors
(cluster.tp_group) alike. Nothing here imports Ray at module level."""
from __future__ import annotations

import os


def bind_host(local: bool) -> str:
    """Where this process's listeners bind: loopback in a local cluster, else the node's address."""
    return "127.0.0.1" if local else node_address()


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


_PRIORITY_SAID = False


def normal_priority() -> None:
    """Run this process at normal priority (nice 0) for its whole life: every thread it has now
    (Linux niceness is per thread; threads made later inherit their maker's). Ray starts its
    workers at nice 15, where an engine step yields to any other process on the node. Raising
    priority needs CAP_SYS_NICE: without it (a non-root pod) the process keeps the niceness it
    has, and the log says so once."""
    import logging

    global _PRIORITY_SAID
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    refused = None
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError as exc:
            refused = exc
        except OSError:  # a thread that has just ended
            continue
    if refused is not None and not _PRIORITY_SAID:
        _PRIORITY_SAID = True
        logging.getLogger(__name__).warning(
            "cannot raise this worker's priority to nice 0 (%s; needs CAP_SYS_NICE): it keeps nice %d",
            refused.strerror, os.getpriority(os.PRIO_PROCESS, 0))


def ucx_net_devices(local: bool) -> str:
    """UCX's devices for NIXL: loopback in a local cluster; on a node of a real cluster the
    interface that holds the node's address (where the other nodes reach it), or "" (UCX picks)
    when none does. UCX_NET_DEVICES set in the worker's environment wins over both."""
    if local:
        return "lo"
    return interface_of(node_address())


def interface_of(ip: str) -> str:
    """The network interface holding the IPv4 address `ip`, or "" (Linux: SIOCGIFADDR per interface)."""
    import fcntl
    import socket
    import struct

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if addr == ip:
                return name
    return ""
