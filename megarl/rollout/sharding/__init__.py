"""Sharding manager: megatron shards (TP/PP/VPP/EP) → HF-named tensors for the rollout layout, in buckets.

`plan` is the pure planner (metadata in, buckets out); `transport` (TP shards sent point to point
to the rollout ranks, one message per TP rank per bucket; on one CPU host packed straight into the
rollout rank's shared memory, `shm`) gathers each bucket into one `protocol.FlatBucket`; `manager.ShardingManager` ties them to a model's chunks and hands each
bucket, as it is, to a `protocol.Sender`: `senders.InPlaceSender` (engine in this process),
`ipc.IpcSender` (CUDA IPC / shared-memory handles to a vLLM engine-core process) or
`broadcast.BroadcastSender` (gloo/NCCL group to engine servers); `senders.sender_for(engine)`
picks one for an engine. `plan` imports only torch and `megarl.models.mapping` / `weight_map`; `protocol` only
torch and `plan`; no module here imports an engine module.
"""

from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, Bucket, HFSpec, ParamMeta, PlanError, SyncPlan, plan_sync

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "HFSpec", "ParamMeta", "PlanError", "SyncPlan", "plan_sync"]
