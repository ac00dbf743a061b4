"""GPU hardware tables for the planner: peak dense bf16 FLOP/s, HBM size and bandwidth, NVLink, network.

Owns: `GPUSpec`, `GPUS` (H100, H200, A100, B200 SXM parts) and `gpu_spec(name, **overrides)`.
Numbers are the vendors' datasheet figures (dense, no sparsity); the network figure is one GPU's
share of the node's scale-out bandwidth (one 400 Gb/s NIC per GPU = 50 GB/s; 800 Gb/s on B200).
Pure Python; imports nothing of megarl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 10**9
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model, as the planner sees it (every field overridable from the CLI)."""

    name: str
    """Table key (H100, H200, A100, B200)."""
    hbm_bytes: int
    """Device memory in bytes (the total `nvidia-smi` / `torch.cuda.mem_get_info` report)."""
    bf16_flops: float
    """Dense bf16 peak, FLOP/s."""
    hbm_bandwidth: float
    """HBM bandwidth, bytes/s."""
    nvlink_bandwidth: float
    """NVLink bandwidth per GPU, one direction, bytes/s (intra-node collectives)."""
    network_bandwidth: float
    """Scale-out bandwidth per GPU, one direction, bytes/s (inter-node collectives, broadcasts)."""


GPUS = {
    "H100": GPUSpec("H100", 81559 * MiB, 989e12, 3.35e12, 450 * GB, 50 * GB),
    "H200": GPUSpec("H200", 143771 * MiB, 989e12, 4.8e12, 450 * GB, 50 * GB),
    "A100": GPUSpec("A100", 81920 * MiB, 312e12, 2.04e12, 300 * GB, 25 * GB),
    "B200": GPUSpec("B200", 183359 * MiB, 2250e12, 8.0e12, 900 * GB, 100 * GB),
}
"""SXM parts; HBM as nvidia-smi reports the total (MiB). H100/H200/B200: 400/400/800 Gb/s NIC per GPU; A100: 200 Gb/s per GPU."""

OVERRIDES = {
    "hbm_gb": ("hbm_bytes", GB),
    "tflops": ("bf16_flops", 1e12),
    "hbm_tbps": ("hbm_bandwidth", 1e12),
    "nvlink_gbps": ("nvlink_bandwidth", GB),
    "network_gbps": ("network_bandwidth", GB),
}
"""CLI names of the overridable fields -> (field, unit): --hbm-gb 94 --tflops 700 --network-gbps 25."""


def gpu_spec(name: str = "H100", **overrides) -> GPUSpec:
    """The table's GPU `name` (case-insensitive) with `overrides` (keys of OVERRIDES, None = keep) applied."""
    key = name.upper()
    if key not in GPUS:
        raise ValueError(
            f"--gpu {name!r} is not in the hardware table; pick one of {', '.join(GPUS)} (and"
            " override fields with --hbm-gb, --tflops, --hbm-tbps, --nvlink-gbps, --network-gbps)"
        )
    changes = {}
    for option, value in overrides.items():
        if value is None:
            continue
        if option not in OVERRIDES:
            raise ValueError(f"unknown hardware override {option!r}; valid: {', '.join(OVERRIDES)}")
        if value <= 0:
            raise ValueError(f"--{option.replace('_', '-')}={value} must be > 0")
        field, unit = OVERRIDES[option]
        changes[field] = type(getattr(GPUS[key], field))(value * unit)
    return dataclasses.replace(GPUS[key], **changes)
