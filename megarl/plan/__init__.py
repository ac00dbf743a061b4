"""`megarl plan`: predicted memory per role and GPU, and time per phase, of a run's layout; layout search.

    hardware.py  GPU tables (H100, H200, A100, B200: bf16 peak, HBM size/bandwidth, NVLink, network)
    presets.py   model sizes by name for configs whose model path exists only on the cluster
    memory.py    bytes per GPU: weights, grads, optimizer, activations, log-prob buffers, vLLM, sync
    planner.py   Plan of a RunConfig: per pool and phase memory, per phase time, fit and margin
    search.py    valid layouts for a GPU count (config validation's divisibility rules), ranked
    report.py    table and JSON output

Layer: above megarl.config (it reads RunConfig and `derive`), below workers; imports no megatron,
vLLM or Ray, so it runs on a laptop in well under a second.
"""

from megarl.plan.hardware import GPUS, GPUSpec, gpu_spec
from megarl.plan.planner import Assumptions, Plan, plan_run
from megarl.plan.presets import PRESETS, resolve_dims

__all__ = ["Assumptions", "GPUS", "GPUSpec", "PRESETS", "Plan", "gpu_spec", "plan_run", "resolve_dims"]
