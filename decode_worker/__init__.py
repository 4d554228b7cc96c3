"""Decode pool worker: preallocates destination pages, waits for KV, runs the continuous decode
batch and streams tokens. May import engine and kv_transfer; never Ray or router.
"""
