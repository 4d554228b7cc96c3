"""Attention backends behind one interface (see base.py), picked by name through a small
registry so that optional ones (flashinfer, CUDA only) are imported lazily.

`auto` picks flashinfer on a CUDA device where it is installed, the compiled CPU kernel on a CPU
where it builds (cpu_ext.py), and the plain torch reference otherwise."""
from __future__ import annotations

import importlib
import importlib.util

import torch

from engine.attention.base import AttentionBackend, AttentionSpec, BatchLayout, write_kv

_BACKENDS = {
    "torch": "engine.attention.torch_backend:TorchAttentionBackend",
    "cpu": "engine.attention.cpu_backend:CpuAttentionBackend",
    "flashinfer": "engine.attention.flashinfer_backend:FlashInferAttentionBackend",
}
BACKEND_NAMES = ("auto", *_BACKENDS)


def flashinfer_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {list(BACKEND_NAMES)}, got {name!r}")
    if name == "auto":
        if flashinfer_available(device):
            return "flashinfer"
        from engine.attention import cpu_ext  # builds the kernel on first use

        return "cpu" if device.type == "cpu" and cpu_ext.available() else "torch"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend='cpu' needs a CPU device; device is {device.type!r}")
    if name == "flashinfer" and not flashinfer_available(device):
        raise ValueError(
            "attention_backend='flashinfer' needs a CUDA device and the flashinfer-python package "
            f"(pip install 'pdcluster[gpu]'); device is {device.type!r}"
        )
    return name


def create_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    module_name, cls_name = _BACKENDS[resolve_backend_name(name, spec.device)].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(spec)


__all__ = ["AttentionBackend", "AttentionSpec", "BatchLayout", "write_kv", "create_backend", "resolve_backend_name", "BACKEND_NAMES"]
