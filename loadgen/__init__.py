"""Load for pdcluster's two paths, and what it measures: requests against a serving endpoint
(workloads.py, client.py, metrics.py: TTFT, TPOT, ITL, goodput; report.py) and KV transfers
between two processes (kv.py). `bench` and `planning` both use it; it imports neither, nor any
server package but the wire stubs in proto/ and kv_transfer for the transfer probe.
"""
