"""`pdcluster model import-gguf FILE DIR`: a GGUF checkpoint (llama.cpp's format, often
quantized) into a Hugging Face checkpoint folder the engine loads: config.json, the tokenizer
with its chat template, and float safetensors. The weights are dequantized by transformers'
own GGUF loader (it needs the `gguf` package: `pip install 'pdcluster[models]'`); tied
embeddings are written once, as the model declares them."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write `gguf_file` as an HF checkpoint folder at `out_dir` (replaced whole, atomically:
    a failed import leaves no half-written folder)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file)
    if not src.is_file():
        raise ValueError(f"GGUF file {str(src)!r} does not exist")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch_dtype)
        cfg = model.config
        weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(cfg, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)  # the embedding, shared
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.architectures = [type(model).__name__]
        if hasattr(cfg, "quantization_config"):  # dequantized: the folder holds plain floats
            delattr(cfg, "quantization_config")
        cfg.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf_file", help="the .gguf file")
    parser.add_argument("out_dir", help="the checkpoint folder to write (replaced if it exists)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the written weights (default float32)")


def run(args: argparse.Namespace) -> int:
    try:
        out = import_gguf(args.gguf_file, args.out_dir, args.dtype)
    except (ValueError, OSError, ImportError) as exc:
        print(f"pdcluster model import-gguf: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
