"""Client-side serving benchmark (`pdcluster bench serve`): workloads, a gRPC load client,
metrics (TTFT, TPOT, ITL, E2E, goodput) and reports. Imports nothing from the server packages
except the wire stubs in proto/."""
