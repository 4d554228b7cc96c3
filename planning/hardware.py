"""GPU specifications the roofline model needs, so plans can be made for hardware we do not have.

Figures are dense (no structured sparsity) BF16 tensor-core peaks, HBM bandwidth, memory and
per-GPU NVLink bandwidth from the vendor datasheets named beside each entry. `price_per_hour`
is a placeholder default for cost comparisons; pass your own with `dataclasses.replace`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(slots=True, frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float            # dense BF16 FLOP/s
    hbm_bytes_per_s: float       # memory bandwidth
    memory_bytes: float
    interconnect_bytes_per_s: float   # NVLink (or PCIe) per GPU, one direction used for all-reduce
    network_bytes_per_s: float = 400e9 / 8   # cross-node KV path: 400 Gb/s InfiniBand by default
    price_per_hour: float = 0.0


GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 312 TFLOPS BF16 dense, 2,039 GB/s, NVLink 600 GB/s
    "A100-80GB": GPUSpec("A100-80GB", 312 * TB, 2039 * GB, 80 * GB, 600 * GB, price_per_hour=1.8),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 1,979 TFLOPS BF16 with sparsity -> 989 dense, 3.35 TB/s, NVLink 900 GB/s
    "H100": GPUSpec("H100", 989 * TB, 3.35 * TB, 80 * GB, 900 * GB, price_per_hour=3.0),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16 dense, 4.8 TB/s, 141 GB, NVLink 900 GB/s
    "H200": GPUSpec("H200", 989 * TB, 4.8 * TB, 141 * GB, 900 * GB, price_per_hour=3.8),
    # NVIDIA L40S datasheet: 362 TFLOPS BF16 dense (733 with sparsity), 864 GB/s, 48 GB, PCIe Gen4 x16 64 GB/s
    "L40S": GPUSpec("L40S", 362 * TB, 864 * GB, 48 * GB, 64 * GB, price_per_hour=1.0),
    # NVIDIA B200 datasheet (HGX B200, per GPU): 2.25 PFLOPS BF16 dense (4.5 sparse), 8 TB/s, 180 GB, NVLink 1.8 TB/s
    "B200": GPUSpec("B200", 2250 * TB, 8 * TB, 180 * GB, 1800 * GB, price_per_hour=6.0),
}


def get_gpu(name: str) -> GPUSpec:
    """The spec by name (case-insensitive; 'H100-SXM', 'A100' are accepted aliases)."""
    key = name.upper().removesuffix("-SXM")
    key = {"A100": "A100-80GB", "A100-80GB-SXM": "A100-80GB"}.get(key, key)
    for k, spec in GPUS.items():
        if k.upper() == key:
            return spec
    raise ValueError(f"gpu {name!r} is unknown; known: {list(GPUS)}")


def cpu_here(flops_per_core: float = 50e9, bytes_per_s: float = 10 * GB) -> GPUSpec:
    """A rough single-thread CPU 'device' (the cluster runs one thread per worker); only a
    coarse default, the profiler measures the real thing."""
    return GPUSpec(f"cpu-{os.cpu_count()}core", flops_per_core, bytes_per_s, 16 * GB, 10 * GB)
