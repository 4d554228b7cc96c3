"""Linear layers for small CPU batches: oneDNN on a weight packed once at load.

Measured on the 2-core AVX2 EPYC (torch 2.13 CPU wheel, one thread): MKL's sgemm runs a product
of 2 or 3 rows as that many matrix-vector products, each reading the whole weight, so a decode
step of two sequences took 1.5x one of a single sequence (small model, 5.2 -> 7.7 ms), most of
the difference in the wide matmuls (lm_head, gate/up). oneDNN's matmul on a pre-packed weight
reads it once. Its time over MKL's for one weight alone, in a loop (so the weight stays in cache):

    in -> out      M=1   M=2   M=4   M=8   M=24  M=64  M=512
    256 -> 8192    1.03  0.48  0.61  0.61  0.64  0.83  0.94
    768 -> 4096    1.06  0.57  0.65  0.81  0.81  1.02  1.15
    2048 -> 768    1.47  0.73  0.53  0.62  0.85  1.15  1.19
    256 -> 1536    1.27  0.81  0.87  0.89  0.99  1.09  1.18
    256 -> 512     2.73  1.32  1.37  1.16  1.06  1.08  1.06

So `PackedLinear` keeps both: MKL for one row and for prefill-sized batches (past `MAX_ROWS`),
oneDNN in between, and only weights of at least `MIN_WEIGHT_BYTES` are packed. The packed copy
adds those weights' size again to the process's memory (presets `small`: 17 MB on 34 MB of
parameters; `bench`: 382 MB on 476 MB).
Float32 on CPU only; anything else keeps plain `F.linear`. Whole decode steps, packed against
plain in one process: `pdcluster bench decode-step --compare linear` (docs/benchmarks.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 32
MIN_WEIGHT_BYTES = 1 << 20


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` for 2-D x, through oneDNN when 2 <= rows <= MAX_ROWS."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # shared with the model's parameters, not copies
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.active = True  # False: always F.linear (`pdcluster bench decode-step --compare linear`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.active and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` whose weight is at least MIN_WEIGHT_BYTES for a
    `PackedLinear` over the same tensors; returns the bytes the packed copies add."""
    added = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.nbytes >= MIN_WEIGHT_BYTES:
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                added += child.weight.nbytes
    return added
