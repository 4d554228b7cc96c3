"""gRPC front door: validation, tokenization, placement policies, admission, streaming.
May import engine (tokenizer, block hashes) and proto; never the worker internals directly.
"""
