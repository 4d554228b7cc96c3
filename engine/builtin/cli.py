"""`pdcluster model make-tiny DIR --arch ... --preset ... --seed N`: write a built-in
checkpoint and print what was written. torch/tokenizers load only inside `run`."""
from __future__ import annotations

import argparse
import sys

from engine.builtin.presets import ARCHS, PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output folder (created; our files are overwritten)")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model architecture (default: llama)")
    parser.add_argument("--preset", choices=PRESETS, default="tiny",
                        help="size: tiny for tests, small for the demo, bench for CPU perf (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")


def run(args: argparse.Namespace) -> int:
    import time

    from engine.builtin.presets import model_spec
    from engine.builtin.writer import write_checkpoint

    start = time.perf_counter()
    try:
        result = write_checkpoint(args.dir, arch=args.arch, preset=args.preset, seed=args.seed)
    except ValueError as exc:
        print(f"pdcluster model make-tiny: {exc}", file=sys.stderr)
        return 2
    spec = model_spec(args.arch, args.preset)
    print(f"wrote {spec.hf_class} ({args.arch}/{args.preset}, seed {args.seed}) to {result.path} "
          f"in {time.perf_counter() - start:.1f}s")
    print(f"  params: {result.param_count:,} ({'tied' if spec.tie_word_embeddings else 'untied'} embeddings, "
          f"vocab {spec.vocab_size}, hidden {spec.hidden_size}, layers {spec.num_hidden_layers}, "
          f"heads {spec.num_attention_heads}/{spec.num_key_value_heads} kv, head_dim {spec.head_dim})")
    for path in result.files:
        print(f"  {path.name:<24} {path.stat().st_size:>12,} bytes")
    return 0
