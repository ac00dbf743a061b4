"""The sharding manager: a training replica's megatron shards → HF-named tensors at the rollout ranks.

Owns: `TrainGroups` (the process groups and rank grid of one model replica) and
`ShardingManager`, which exchanges parameter metadata once per model (one `all_gather_object`
over the model-parallel group, then cached), plans buckets with `plan.plan_sync`, and runs the
in-process transport (`transport.stream_buckets`) bucket by bucket. Every rank of the replica calls
`sync(sender, version)` (or iterates `iter_buckets()`); rollout ranks hand each `FlatBucket` to
their `Sender` as it is (in place, IPC or broadcast: `protocol.py`), the others only take part in
the collectives. Before any bytes move the rollout ranks check the planned names and shapes with
their sender and all ranks agree (one small collective), so a bad update fails everywhere with
the engine's message and nothing is loaded.

Expert parallelism (MoE): a replica is TP × EP × PP ranks (`mp_group` is megatron's tp-ep-pp
group); every EP rank's TP ranks send their own experts' weights, EP rank 0's send the rest, so
the rollout ranks receive every expert under its global HF name with no EP gather on the way.

Must not import the training engine: it takes model chunks, a `ModelBridge` and process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

import torch

from megarl.rollout.sharding.pack import unpack_bucket
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, HFSpec, ParamMeta, SyncPlan, plan_sync
from megarl.rollout.sharding.protocol import FlatBucket, Sender, WeightUpdateError
from megarl.rollout.sharding.shm import ShmPeers, free_bytes, host_id, ring_room, same_host
from megarl.rollout.sharding.transport import KeptBuffers, SyncBuffers, lands_flat, stream_buckets


@dataclass
class TrainGroups:
    """Process groups of one model replica of the training layout (TP × PP, × EP for MoE).

    The transport moves bytes point to point within `mp_group` (peers named by global rank), which
    also carries the one metadata exchange and the agreement before an update. `tp_group` is kept
    for callers and for collective transports; the point-to-point transport does not use it.
    Context-parallel ranks hold the same weights as their CP peers (like DP ranks): every (DP, CP)
    index is a replica of its own, and its TP × PP group is all a sync needs.
    """

    tp_group: object
    mp_group: object
    """All TP × PP (× EP) ranks of the replica (metadata exchange, agreement)."""
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def from_parallel_state(cls) -> "TrainGroups":
        """Megatron's global groups (`init_megatron`); the training engine passes its own collection."""
        from megatron.core import parallel_state as ps

        ep_size = ps.get_expert_model_parallel_world_size()
        replica = ps.get_expert_tensor_model_pipeline_parallel_group() if ep_size > 1 else ps.get_model_parallel_group()
        return cls(
            ps.get_tensor_model_parallel_group(),
            replica,
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank() if ep_size > 1 else 0,
            ep_size,
        )

    @property
    def source(self) -> tuple[int, int]:
        """(pp_rank, ep_rank) of this rank: the key of its TP group in the manager's `stage_ranks`."""
        return self.pp_rank, self.ep_rank


class ShardingManager:
    """Planned, bucketed weight sync from megatron chunks to rollout engines.

    bridge: the actor's `ModelBridge` (weight map, dims); chunks: this rank's model chunks (one
    per virtual stage); rollout_ranks: global ranks of the replica that feed an engine (default:
    the first rank of the first stage); bucket_bytes: bound of one bucket (gathered bytes);
    prefetch: buckets a rollout rank receives ahead while it unpacks (0: strictly one at a time);
    keep_shared_buffers: for a sender whose engine is another process on CPU (`Sender.shares_buffers`
    and `keeps_buffers`: vLLM by IPC), keep one shared-memory buffer per bucket from sync to sync
    (`transport.KeptBuffers`: no fresh pages to allocate and zero after the first sync, for about the
    model's HF bytes of host memory held between syncs); False: fresh buffers every sync. An engine
    that takes synced buckets as its parameters brings buffers of its own (`InPlaceSender.adopt_into`).
    On CPU the transport's reusable rings (`transport.SyncBuffers`: up to 3 × bucket_bytes on a
    rollout rank by default, 2 packed shares on a sender) are kept from sync to sync too.
    host_shm: where every rank of the replica is a CPU process on one host, senders write their shards
    straight into the rollout ranks' shared-memory buffers (`shm.ShmPeers`) instead of sending them
    over gloo (used when /dev/shm has 4 × max(bucket_bytes, 256 MiB) free on every rank); False: gloo
    messages. With CUDA the transport is always NCCL's.
    """

    def __init__(
        self,
        bridge,
        chunks: Sequence[torch.nn.Module],
        groups: Optional[TrainGroups] = None,
        *,
        rollout_ranks: Optional[Sequence[int]] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        prefetch: int = 1,
        keep_shared_buffers: bool = True,
        host_shm: bool = True,
    ):
        import torch.distributed as dist

        self.bridge = bridge
        self.groups = groups or TrainGroups.from_parallel_state()
        self.bucket_bytes = bucket_bytes
        self.prefetch = prefetch
        self.kept = KeptBuffers() if keep_shared_buffers else None
        self._buffers: dict[bool, SyncBuffers] = {}  # per `shared`: the last completed sync's rings (CPU)
        self.rank = dist.get_rank()
        self._local = self._local_params(chunks)
        self._rollout_ranks = rollout_ranks
        self._plan: Optional[SyncPlan] = None
        self.stage_ranks: dict[tuple[int, int], list[int]] = {}
        self.metadata_exchanges = 0
        self.host_shm = host_shm
        self.peers: Optional[ShmPeers] = None  # set by the plan: every rank of the replica on this CPU host
        self._adoption_fits: Optional[bool] = None  # `_room_to_adopt`, decided once

    def _local_params(self, chunks) -> dict:
        from megarl.models.spec import layer_offset

        self._metas, local = [], {}
        for vp_stage, chunk in enumerate(chunks):
            model = _unwrap(chunk)
            offset = layer_offset(model.config, self.groups.pp_rank, vp_stage if len(chunks) > 1 else None)
            for name, param in model.named_parameters():
                local[(vp_stage, name)] = param
                if self.groups.ep_rank and not self.bridge.weight_map.lookup(name, offset).expert:
                    continue  # EP rank 0 reports the parameters every EP rank holds
                self._metas.append(
                    ParamMeta(
                        name,
                        tuple(param.shape),
                        str(param.dtype).replace("torch.", ""),
                        self.groups.pp_rank,
                        vp_stage,
                        offset,
                        self.groups.ep_rank,
                    )
                )
        return local

    # -- planning (metadata exchanged once) ---------------------------------------------------
    @property
    def plan(self) -> SyncPlan:
        if self._plan is None:
            self._plan = self._exchange_and_plan()
        return self._plan

    def _exchange_and_plan(self) -> SyncPlan:
        import torch.distributed as dist

        g = self.groups
        host = None if torch.cuda.is_available() else host_id(min_free_bytes=ring_room(self.bucket_bytes))
        mine = (g.source, g.tp_rank, self.rank, self._metas if g.tp_rank == 0 else None, host)
        everyone = [None] * dist.get_world_size(g.mp_group)
        dist.all_gather_object(everyone, mine, group=g.mp_group)
        self.metadata_exchanges += 1
        grid = {(pp, ep): [None] * g.tp_size for pp in range(g.pp_size) for ep in range(g.ep_size)}
        metas = []
        for source, tp, rank, stage_metas, _ in everyone:
            grid[source][tp] = rank
            metas.extend(stage_metas or [])
        self.stage_ranks = grid
        if self.host_shm and len(everyone) > 1 and same_host([e[4] for e in everyone]):
            self.peers = ShmPeers()
        if self._rollout_ranks is None:
            self._rollout_ranks = [grid[(0, 0)][0]]
        return plan_sync(
            metas,
            self.bridge.weight_map,
            tp_size=g.tp_size,
            pp_size=g.pp_size,
            bucket_bytes=self.bucket_bytes,
            ep_size=g.ep_size,
        )

    @property
    def rollout_ranks(self) -> list[int]:
        self.plan  # noqa: B018 - resolves the default
        return list(self._rollout_ranks)

    @property
    def is_rollout_rank(self) -> bool:
        return self.rank in self.rollout_ranks

    def hf_specs(self) -> list[HFSpec]:
        return self.plan.hf_specs()

    # -- moving bytes ---------------------------------------------------------------------------
    def iter_buckets(
        self, *, fresh: bool = False, shared: bool = False, into: Optional[KeptBuffers] = None
    ) -> Iterator[FlatBucket]:
        """Every rank must exhaust this; rollout ranks get each bucket as one `FlatBucket`.

        A bucket's buffer stays valid until the next bucket is asked for, or until the end of the
        sync with `fresh` (for consumers that keep tensors, `Sender.keeps_buffers`; with `shared`
        too and `keep_shared_buffers`, the next sync writes into the same buffers); `shared`: in
        shared memory on CPU. `into`: buffers of the consumer's own, one per bucket, which it takes as
        its parameters (`InPlaceSender.adopt_into`): every bucket lands there (shared memory only where
        the replica's other ranks write into them).
        """
        plan, dims = self.plan, self.bridge.dims
        # Taken out while this sync runs (a second, overlapping iteration gets rings of its own);
        # put back only after a complete sync, and only on CPU (`SyncBuffers`).
        buffers = self._buffers.pop(shared, None) or SyncBuffers(self.prefetch, shared=shared or self.peers is not None)
        outputs = buffers.out  # the consumer is done with a bucket when it asks for the next
        kept = into if into is not None else self.kept if fresh and shared else None
        fresh = fresh or into is not None
        with torch.no_grad():
            for bucket, gathered, own_row, sums in stream_buckets(
                plan.buckets,
                self._local,
                my_rank=self.rank,
                stage_ranks=self.stage_ranks,
                dest_ranks=self._rollout_ranks,
                my_source=self.groups.source,
                dims=dims,
                prefetch=self.prefetch,
                fresh=fresh,
                shared=shared,
                kept=kept,
                buffers=buffers,
                group=self.groups.mp_group,
                peers=self.peers,
            ):
                if lands_flat(bucket, self.peers):
                    flat = FlatBucket(gathered[: bucket.hf_numel], bucket.entries, sums=sums)
                else:
                    out = (
                        kept.take(("out", bucket.index), bucket.hf_numel, bucket.dtype, gathered.device, shared=shared)
                        if kept is not None
                        else outputs.take(bucket.hf_numel, bucket.dtype, gathered.device, fresh=fresh)
                    )
                    own = None if own_row is None else (own_row, self._local)
                    flat = unpack_bucket(bucket, gathered, dims, out, own)
                yield replace(flat, kept=True) if kept is not None and kept.holds(flat.buffer) else flat
        if buffers.keepable():
            self._buffers[shared] = buffers
        if self.peers is not None:
            self.peers.end_sync()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every bucket in turn; a tensor is valid until the next bucket starts
        (the last bucket's until the next sync, on CPU, where the buffers are kept)."""
        for bucket in self.iter_buckets():
            yield from bucket.tensors()

    def sync(self, sender: Optional[Sender], version: int) -> Optional[int]:
        """Push the current weights as policy `version`; call on every rank of the replica.

        Rollout ranks pass their engine's `Sender` (`senders.sender_for(engine)`, or a
        `BroadcastSender` to engine servers); the other ranks pass None. Returns the engine's
        version after the update on rollout ranks, None elsewhere.
        """
        specs = self.hf_specs()
        rollout = self.is_rollout_rank
        self._agree(lambda: _check(sender, specs, self.rank) if rollout else None)
        if not rollout:
            for _ in self.iter_buckets():
                pass
            return None
        into = getattr(sender, "adopt_into", None)  # set by the sender's check (`InPlaceSender`, `IpcSender`)
        if into is not None and not self._room_to_adopt(sender.shares_buffers):
            into = sender.adopt_into = None  # the engine copies each bucket in, from the rings
        buckets = self.iter_buckets(fresh=sender.keeps_buffers, shared=sender.shares_buffers, into=into)
        return sender.send(buckets, version)

    def _room_to_adopt(self, shared: bool) -> bool:
        """Whether buckets may land in an adopting engine's buffers: yes unless they are shared memory (the
        replica's other ranks write into them, `peers`, or the engine is another process, `shared`) and
        /dev/shm has no room for the whole model beside the rings. Decided once, at the first such sync
        (its buffers then hold the room)."""
        if self._adoption_fits is None:
            private = self.peers is None and not shared
            self._adoption_fits = private or free_bytes() >= self.plan.total_bytes + ring_room(self.bucket_bytes)
        return self._adoption_fits

    def _agree(self, check) -> None:
        """Run `check` on rollout ranks; every rank raises the first failure.

        One all-reduce of a flag; the messages are gathered only when some rank failed
        (`all_gather_object`, two collectives and pickling: 9.3 against 0.9 ms for four gloo ranks on two
        cores, which made an in-process sync of 0.4 GB 13% slower than its gather)."""
        import torch.distributed as dist

        try:
            check()
            message = None
        except Exception as err:  # noqa: BLE001 - any failure must reach every rank, or the others wait forever
            message = str(err) if isinstance(err, WeightUpdateError) else f"{type(err).__name__}: {err}"
        messages = [message]  # a replica of one rank (DP only): nobody to tell
        group = self.groups.mp_group
        size = dist.get_world_size(group)
        if size > 1 and _any_rank(message is not None, group):
            messages = [None] * size
            dist.all_gather_object(messages, message, group=group)
        failed = [m for m in messages if m]
        if failed:
            raise WeightUpdateError(failed[0])


def _any_rank(flag: bool, group) -> bool:
    """Whether `flag` is set on any rank of `group` (collective: a one-element all-reduce, on the GPU for NCCL)."""
    import torch.distributed as dist

    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _check(sender: Optional[Sender], specs, rank: int) -> None:
    if sender is None:
        raise ValueError(
            f"rank {rank} is a rollout rank of the sharding manager but got no sender: pass"
            " megarl.rollout.sharding.senders.sender_for(engine) (or a BroadcastSender)"
        )
    sender.check(specs)


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module
