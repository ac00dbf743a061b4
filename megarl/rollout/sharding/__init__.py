"""Sharding manager: megatron shards (TP/PP/VPP) → HF-named tensors for the rollout layout, in buckets.

`plan` is the pure planner (metadata in, buckets out); `transport` (TP shards sent point to point
to the rollout ranks, one message per TP rank per bucket), `broadcast` (gloo/NCCL group to engine
servers) and `ipc` (CUDA IPC / shared-memory handles to vLLM engine-core processes) move bytes by
its plan; `manager.ShardingManager` ties them to a model's chunks.
`plan` imports only torch and `megarl.models.mapping`.
"""
from megarl.rollout.sharding.plan import (DEFAULT_BUCKET_BYTES, Bucket, HFSpec, ParamMeta, PlanError, SyncPlan,
                                          plan_sync)

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "HFSpec", "ParamMeta", "PlanError", "SyncPlan", "plan_sync"]
