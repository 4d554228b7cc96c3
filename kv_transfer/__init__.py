"""KV cache transfer between processes: transports (nixl, grpc, local), descriptors, handshake,
page-size/head-range/dtype layout conversion. Must not import Ray, router, or the workers.
"""
