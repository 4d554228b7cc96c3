"""Prefill pool worker: batches and chunks prefills, reuses prefix-cached pages, samples the
first token and sends KV layer by layer. May import engine and kv_transfer; never Ray or router.
"""
