"""Broadcast transport: one trainer rank → N engine servers over their own process group.

Owns: `BroadcastSender` and `BroadcastReceiver`, which talk over a `WeightGroup` (`weight_group.py`, exported
here too: a gloo or NCCL process group built from a TCPStore, outside the default group, so a trainer rank that
is already in its training world and Ray engine actors can share it).

One update: `check` broadcasts a small header (the planned HF names, shapes and dtypes), every
receiver checks it against its engine and the group all-gathers the verdicts, so a bad update fails
on every member with the engine's message before any weight moves; then `send` broadcasts the
policy version and, per `FlatBucket`, a 3-number control message, the bucket's layout (entries;
only when it differs from what the receivers hold for that position, so once per model) and the
bucket's buffer as it is (no concatenation; copied only if the group lives on another device), then
(`verify`, on by default) the bucket's per-tensor checksums (`protocol.checksums`; those its writers took as
they wrote it, `writesums`, where they did).
Receivers take each bucket into a buffer of its own (fresh, or for an engine in another process
kept per bucket position from update to update; on CPU, for an engine that is done with a bucket
when it asks for the next, two buffers reused in turn by every bucket and update: fresh pages cost
several times the bytes' copy) and hand it with its checksums to their engine's own sender
(`senders.sender_for`: in place, or IPC for a vLLM core in a child process). An engine in the receiver's
process gets the update's first bucket only once its checksums passed, and every later CPU bucket with
its checksums still to check as it copies each tensor (`protocol.pending_tensors`; other engines: each
bucket checked first), while the next bucket arrives on a thread of its own (`receive_ahead`); an IPC hop
passes them on to vLLM's workers, which check them there (end to end, and the server sums nothing
itself). A final all-gather collects the engines' versions, or their errors. A receiver whose engine
fails mid-update (a corrupted bucket, a load error) keeps reading the update to its end, so the group
stays in step, and the sender raises `WeightUpdateError` with that engine's message. gloo on CPU
(tested), NCCL on GPU.

Same host (gloo, `BroadcastSender(shm=True)`, the default): at the first `check` every member all-gathers
its `shm.host_id` and user id; where all are equal no bucket byte crosses the group's TCP. Per bucket the
sender broadcasts the control message, the layout (when new), then the buffer's place in its shared memory
(`shm.ShmPeers.place`: the manager gathers into shared memory for such a sender, `shares_buffers`; another
buffer is copied into a staging buffer first) and its checksums in one message; each receiver maps the buffer
(once) and hands it on as above (an in-process engine copies from the mapping into its model, checking as it
copies; one that keeps its buckets or passes them to another process gets a copy of its own first), and every
member meets at a sync point (a one-element all-reduce) once its engine is done with it before the manager
writes a later bucket there. Delta updates are full ones there. Adoption (`adopt`, the default, for a sharding
manager's syncs into engines in their receivers' processes that can, `EmbeddedEngine.adopts_update`): the
manager gathers every bucket into shared memory this sender keeps per bucket position (`adopt_into`), and
each engine takes the mapped buckets as its parameters (`load_buckets`): from the second sync on the trainer's
ranks write straight into the engines' models, which only check what they hold, with no sync point per bucket
(a bucket's memory is its own), while they hold their weights lock (the sender waits for that at the update's
start). The price: a corrupted bucket is found in the model, and the engine then refuses requests until an
update succeeds (`UpdateProgress.touched`), as for in-process and IPC adoption. On 2 cores the 0.4 GB sync of
`benchmarks/weight_sync.py` was 0.16–0.20× a copy's bytes/s over TCP, 0.45–0.58× by shared memory with the
receiver's copy (the gather plus that copy), 0.57–0.80× adopted (the gather plus the check's read).
"""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

import torch

from megarl.rollout.sharding.delta import DELTA_DTYPES, changed_elements
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, HFSlot, HFSpec
from megarl.rollout.sharding.protocol import (
    FlatBucket,
    WeightUpdateError,
    alloc_flat,
    bucket_tensors,
    checksums,
    verify_bucket,
)
from megarl.rollout.sharding.receive_ahead import ReceiveAhead
from megarl.rollout.sharding.senders import sender_for
from megarl.rollout.sharding.shm import PLACE_BYTES, ShmPeers, host_id, ring_room, same_host
from megarl.rollout.sharding.transport import BufferRing, KeptBuffers, adoption_enabled
from megarl.rollout.sharding.weight_group import WeightGroup
from megarl.utils.faults import hold

__all__ = ["BroadcastReceiver", "BroadcastSender", "WeightGroup"]

_BEGIN, _BUCKET, _END, _DELTA, _SHARED, _ADOPTED = 2, 1, 0, 3, 4, 5
"""Kinds of the control message that precedes every part of an update: [kind, value, new layout] (for
`_BEGIN`: [kind, version, how buckets cross: 0 the group's wire, 1 shared memory, 2 shared memory the
engines take as their parameters]; `_ADOPTED`: a bucket in that memory)."""
_ADOPTS = "adopts"
"""A receiver's verdict on an update's header: it accepts it and its engine can take the buckets as its parameters."""
_FAILED = "failed: "
"""How a receiver's final reply starts when its engine failed the update (its version otherwise)."""


class BroadcastSender:
    """Trainer side, rank 0 of its weight group: a `Sender` to every engine server in the group.

    shm: where every member of a gloo group runs on this host (`shm.host_id`, probed once, at the first
    `check`), the buckets cross by shared memory instead of the group's TCP (`shares_buffers` is then True:
    the sharding manager gathers into shared memory): per bucket, only a control message, the buffer's place
    (`shm.ShmPeers`) and its checksums are broadcast; each receiver maps the buffer (once, kept from update
    to update) and copies from it into its engine (checking as it copies, where the engine does), and the
    sender takes the next bucket only once every receiver said it was done with this one. Delta updates
    (`delta`) then send nothing sparse: shared memory moves no bytes over a wire. False: always the TCP
    broadcast, which a group with a member on another host uses anyway, and so does a sender whose /dev/shm
    has no room for the sharding manager's shared rings (`shm.ring_room`: 1 GiB at the default bucket bound;
    a container's default /dev/shm is 64 MiB).
    """

    keeps_buffers = False  # a broadcast has completed on every member before the next bucket is asked for

    def __init__(
        self, group: WeightGroup, *, verify: bool = True, delta: bool = False, shm: bool = True, adopt: bool = True
    ):
        if group.rank != 0:
            raise ValueError("the sender must be rank 0 of its weight group")
        self.group, self.verify, self.delta = group, verify, delta
        self.shm = shm and group.backend == "gloo"
        # `adopt` (same host): buckets land in shared memory kept for these engines, which take it as their
        # parameters (`adopt_into`, set by `check` where every receiver can; `MEGARL_ADOPT_WEIGHTS=0`: never)
        self.adopt = self.shm and adopt and adoption_enabled()
        self._adopted = KeptBuffers()
        self.adopt_into: Optional[KeptBuffers] = None
        self._adopting = False  # this update's buckets land in `_adopted`
        self._same_host: Optional[bool] = None  # every member on this host: probed at the first check
        self._via_shm = False  # this update's buckets cross by shared memory
        self._peers = ShmPeers()
        self._staging = BufferRing(1, shared=True)  # a bucket that is not in shared memory is copied here
        self._layouts: list = []  # (dtype, entries) per bucket position, as the receivers have them
        self._held: dict[int, torch.Tensor] = {}  # delta: each 16-bit bucket as the receivers hold it
        self.sent_bytes = 0
        """Bytes of bucket data the receivers took from the last update: broadcast (buffers, or delta
        indices and values), or read from shared memory."""

    @property
    def shares_buffers(self) -> bool:
        """Buckets of this update are read by other processes from shared memory (set by `check`)."""
        return self._via_shm

    def check(self, specs: Sequence[HFSpec], *, partial: bool = False) -> None:
        """Announce the update; raises the first engine's WeightUpdateError (on every member)."""
        header = {
            "specs": [(s.name, tuple(s.shape), str(s.dtype).replace("torch.", "")) for s in specs],
            "partial": partial,
            "verify": self.verify,
            "delta": self.delta,
            "probe": self.shm and self._same_host is None,  # every member then all-gathers its host id
            "adopt": self.adopt and not partial,
        }
        self.group.broadcast_object(header)
        if header["probe"]:  # this side: a host id only with room in /dev/shm for the manager's shared rings
            mine = _host_and_user(min_free_bytes=ring_room(DEFAULT_BUCKET_BYTES))
            self._same_host = same_host(self.group.all_gather_messages(mine))
        self._via_shm = bool(self.shm and self._same_host)
        verdicts = self.group.all_gather_messages(None)
        failures = [(i, m) for i, m in enumerate(verdicts) if m and m != _ADOPTS]
        if failures:
            raise WeightUpdateError(f"engine server {failures[0][0]} rejected the update: {failures[0][1]}")
        adopts = self._via_shm and header["adopt"] and all(m == _ADOPTS for m in verdicts[1:])
        self.adopt_into = self._adopted if adopts else None  # the manager may still decline (no room)

    def send(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """Each bucket buffer as it is, broadcast or by shared memory; returns the lowest engine version after
        the update."""
        self._adopting, self.adopt_into = self.adopt_into is not None, None  # this sync's only
        self._control(_BEGIN, version, 2 if self._adopting else int(self._via_shm))
        if self._adopting:  # every engine holds its weights lock before a byte is written into its parameters
            self.group.sync_point()
        self.sent_bytes = 0
        try:
            for position, bucket in enumerate(buckets):
                if self._via_shm:
                    self._share_bucket(position, bucket)
                else:
                    self._send_bucket(position, bucket)
                if position == 0:
                    hold("weights.broadcast")  # fault injection: an update under way
        except BaseException:
            self._held.clear()  # the receivers may not hold what this side thinks: the next update is dense
            raise
        finally:
            self._peers.end_sync()
        self._control(_END)
        replies = self.group.all_gather_messages("0")[1:]
        failed = [(i, m) for i, m in enumerate(replies, 1) if m.startswith(_FAILED)]
        if failed:
            self._held.clear()
            raise WeightUpdateError(f"engine server {failed[0][0]}: {failed[0][1][len(_FAILED) :]}")
        return min(int(v) for v in replies)

    def _send_bucket(self, position: int, bucket: FlatBucket) -> None:
        """The bucket's buffer, or with `delta` only its elements whose bits changed since the receivers'
        copy (int32 indices + values; whole when that is not smaller); then its checksums (`verify`)."""
        layout, new = self._layout(position, bucket)
        buffer = bucket.buffer if bucket.buffer.device == self.group.device else bucket.buffer.to(self.group.device)
        changed = changed_elements(buffer, self._held.get(position)) if self.delta and not new else None
        kind, value = (_BUCKET, buffer.numel()) if changed is None else (_DELTA, len(changed))
        self._announce(kind, value, position, layout, new)
        if changed is None:
            moving = self.group.broadcast(buffer, wait=False)
            self.sent_bytes += buffer.numel() * buffer.element_size()
        else:
            values = buffer[changed]
            self.group.broadcast(changed)
            moving = self.group.broadcast(values, wait=False)
            self.sent_bytes += changed.numel() * 4 + values.numel() * values.element_size()
        # the checksums: those the bucket's writers took as they wrote it (`writesums`), else taken while the
        # bytes move (gloo sends from its own thread): off the critical path
        sums = None
        if self.verify:
            mine = bucket.sums if buffer is bucket.buffer else None
            sums = mine if mine is not None else checksums(FlatBucket(buffer, bucket.entries))
        moving.wait()
        if sums is not None:
            self.group.broadcast(sums)
        if self.delta and buffer.dtype in DELTA_DTYPES:
            held = self._held.get(position)
            if held is None or held.shape != buffer.shape:
                self._held[position] = buffer.clone()
            elif changed is None:
                held.copy_(buffer)
            else:
                held[changed] = values

    def _share_bucket(self, position: int, bucket: FlatBucket) -> None:
        """The bucket by shared memory: its place and checksums; returns once every receiver is done reading
        it (the caller may then write into its buffer again; an adopted update's bucket: at once)."""
        buffer, adopted = bucket.buffer, self._adopting
        if adopted and not (bucket.kept and self._adopted.holds(buffer)):  # a caller's own bucket: copied there
            buffer = self._adopted.take(position, buffer.numel(), buffer.dtype, "cpu").copy_(buffer)
        place = self._place(buffer)
        if place is None:  # not in fd shared memory: one copy into the staging buffer
            buffer = self._staging.take(buffer.numel(), buffer.dtype, "cpu").copy_(buffer)
            place = self._peers.place(buffer)
        self._announce(_ADOPTED if adopted else _SHARED, buffer.numel(), position, *self._layout(position, bucket))
        # place and checksums in one message (each collective wakes every member: ms while ranks keep the cores busy)
        if self.verify:  # taken before any receiver can read the buffer; the writers' hold for a staging copy too
            sums = bucket.sums if bucket.sums is not None else checksums(FlatBucket(buffer, bucket.entries))
            message = torch.empty(place.numel() + 8 * sums.numel(), dtype=torch.uint8)
            message[: place.numel()] = place
            message[place.numel() :].view(torch.int64).copy_(sums)
            place = message
        self.group.broadcast(place)
        if not adopted:  # (an adopted bucket's memory is its position's own: no later bucket writes into it)
            self.group.sync_point()  # every receiver is done with the buffer
        self.sent_bytes += buffer.numel() * buffer.element_size()

    def _layout(self, position: int, bucket: FlatBucket) -> tuple[tuple, bool]:
        """The bucket's layout (dtype, entries) and whether the receivers hold another one for its position."""
        layout = (str(bucket.dtype).replace("torch.", ""), tuple(bucket.entries))
        return layout, position >= len(self._layouts) or self._layouts[position] != layout

    def _announce(self, kind: int, value: int, position: int, layout: tuple, new: bool) -> None:
        """A bucket's control message, then its layout where it is new to the receivers (once per model)."""
        self._control(kind, value, new)
        if new:
            self.group.broadcast_object(layout)
            self._layouts[position : position + 1] = [layout]

    def _place(self, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """The message naming `buffer` in its file-descriptor shared memory; None where it lives elsewhere."""
        if buffer.device.type != "cpu" or not buffer.untyped_storage().is_shared():
            return None  # (naming a private buffer would move its storage into shared memory)
        try:
            return self._peers.place(buffer)
        except RuntimeError:  # shared another way (torch's file_system strategy): no descriptor to name
            return None

    def _control(self, kind: int, value: int = 0, new: bool = False) -> None:
        self.group.broadcast(torch.tensor([kind, value, int(new)], dtype=torch.int64, device=self.group.device))

    def update(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> int:
        """Send a list of HF-named tensors (tools and tests), bucketed like any other update."""
        self.check([HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights])
        self.adopt_into = None  # its buckets are not in the kept buffers: the engines copy them in
        return self.send(bucket_tensors(weights, shared=self.shares_buffers), version)

    def close(self) -> None:
        """Tell the receivers to leave their receive loop."""
        self.group.broadcast_object({"close": True})


class BroadcastReceiver:
    """Engine side: `receive_update()` blocks for one update and loads it into `engine` (its own sender)."""

    def __init__(self, group: WeightGroup, engine):
        self.group, self.engine = group, engine
        # an engine in this process may take a same-host sender's shared memory as its parameters (`adopt_into`)
        self.local = sender_for(engine, adopt=getattr(engine, "in_process", True))
        self._layouts: list = []
        # an engine in another process (IPC): one shared-memory buffer per bucket position, reused by
        # every update (no fresh shared-memory pages to allocate and zero after the first)
        self._kept = KeptBuffers() if self.local.shares_buffers else None
        # an engine done with each bucket when it asks for the next (in place, on CPU): two buffers in turn for
        # every bucket (one is checked and loaded while the next arrives, `_buckets`), kept from update to
        # update (a fresh one per bucket is mostly page faults)
        reuse = not self.local.keeps_buffers and not self._kept and group.device.type == "cpu"
        self._ring = BufferRing(2) if reuse else None
        self._held: dict[int, torch.Tensor] = {}  # delta updates: each 16-bit bucket as last received
        # buckets by shared memory (a sender on this host): its buffers, mapped once; an engine that reads a
        # bucket after asking for the next, or hands it to another process, gets a copy of its own
        self._peers = ShmPeers()
        self._copies_shared = self.local.keeps_buffers or self.local.shares_buffers
        self._reading = False  # the engine may still read the sender's buffer of the last bucket
        self._locking = False  # an adopted update: the sender waits until the engine holds its weights lock
        self._adopting = False  # this update's buckets are the engine's parameters: received one ahead too

    def receive_update(self) -> Optional[int]:
        """The engine's new version; None when the sender closed the group.

        Raises WeightUpdateError (and keeps the previous weights) when any member rejected the update's
        header; an engine that fails during the update re-raises its error after reading the update to its end.
        """
        header = self.group.broadcast_object()
        if header.get("close"):
            return None
        if header.get("probe"):
            self.group.all_gather_messages(_host_and_user())
        specs = [HFSpec(n, tuple(s), getattr(torch, d)) for n, s, d in header["specs"]]
        try:
            self.local.check(specs, partial=header["partial"])
            verdict = _ADOPTS if header.get("adopt") and getattr(self.local, "adopt_into", None) is not None else None
        except WeightUpdateError as err:
            verdict = str(err)
        failures = [m for m in self.group.all_gather_messages(verdict) if m and m != _ADOPTS]
        if failures:
            raise WeightUpdateError(failures[0])
        kind, version, via_shm = self._control()
        if kind != _BEGIN:
            raise RuntimeError(f"weight group out of step: expected the start of an update, got message kind {kind}")
        self._position, self._ended, self._via_shm = 0, False, bool(via_shm)
        self._locking = self._adopting = via_shm == 2
        if not self._adopting and hasattr(self.local, "adopt_into"):
            self.local.adopt_into = None  # the buckets are not in memory of the engine's: it copies them in
        self._delta = header.get("delta", False) and not via_shm  # by shared memory every bucket comes whole
        self._ahead: Optional[ReceiveAhead] = None
        if hasattr(self.local, "verify"):  # an IPC hop inside the server checks as the sender asked
            self.local.verify = header.get("verify", True)
        try:
            version = self.local.send(self._buckets(header.get("verify", False)), version)
        except Exception as err:
            self._locked()  # (the engine failed before it took its lock)
            if self._ahead is not None:
                self._ahead.finish()  # its thread reads the rest of the update
            while not self._ended:  # the rest of the update, unread: the group stays in step
                try:
                    self._receive(header.get("verify", False))
                except WeightUpdateError:
                    pass  # a bucket it could not map: read and acknowledged all the same
            self._held.clear()  # the sender sends the next update whole
            self.group.all_gather_messages(f"{_FAILED}{type(err).__name__}: {err}")
            raise
        finally:
            self._peers.end_sync()
        self.group.all_gather_messages(str(version))
        return version

    def _locked(self) -> None:
        """An adopted update: the engine holds its weights lock (or failed before it could); the sender may write."""
        if self._locking:
            self._locking = False
            self.group.sync_point()

    def _control(self) -> list[int]:
        message = torch.empty(3, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(message)
        return message.tolist()

    def _buckets(self, verify: bool):
        """Each broadcast bucket in a buffer of its own (the engine may keep it; two reused in turn when its
        sender says it does not, `_buffer`), checked against its checksums when the sender sends them, until
        the sender's end mark.

        An engine in this process gets the buckets received one ahead, on a thread of its own
        (`ReceiveAhead`): bucket k+1 arrives while bucket k is checked and loaded, and a bucket is handed on
        only once it passed, or with its checksums for an engine that checks as it copies
        (`checks_as_it_copies`). An IPC hop passes the checksums on instead (its vLLM workers check them,
        end to end)."""
        self._locked()  # first asked for inside the engine's weights lock
        if self.local.shares_buffers or (self._via_shm and not self._adopting):  # nothing to receive ahead
            while (received := self._receive(verify)) is not None:
                yield self._hand_on(*received)
            return
        ahead = self._ahead = ReceiveAhead(lambda: self._receive(verify), self._hand_on)
        try:
            while (bucket := ahead.next()) is not None:
                yield bucket
        finally:
            ahead.finish()  # an engine that stopped early: the rest of the update is read there

    def _hand_on(self, bucket: FlatBucket, expected: Optional[torch.Tensor]) -> FlatBucket:
        """A received bucket as the engine's sender takes it: with its checksums still to check (an IPC hop
        passes them on; an engine that checks each CPU tensor as it copies it), else checked whole first."""
        if expected is None:
            return bucket
        defer = getattr(self.local, "checks_as_it_copies", False) and not bucket.buffer.is_cuda
        if self.local.shares_buffers or defer:
            return verify_bucket(bucket, expected)
        _checked_views(verify_bucket(bucket, expected))
        return bucket

    def _receive(self, verify: bool) -> Optional[tuple[FlatBucket, Optional[torch.Tensor]]]:
        """The next bucket and its checksums (None without `verify`); None at the end mark."""
        if self._reading:  # the engine asked for the next bucket: done with the sender's buffer
            self._reading = False
            self.group.sync_point()
        kind, numel, new = self._control()
        if kind == _END:
            self._ended = True
            return None
        position, self._position = self._position, self._position + 1
        if new:
            self._layouts[position : position + 1] = [self.group.broadcast_object()]
        dtype, entries = self._layouts[position]
        if kind == _DELTA:  # `numel` changed elements of the bucket this receiver holds
            buffer, changed = self._held[position], torch.empty(numel, dtype=torch.int32, device=self.group.device)
            values = torch.empty(numel, dtype=buffer.dtype, device=self.group.device)
            self.group.broadcast(changed)
            self.group.broadcast(values)
            buffer[changed] = values
        elif kind in (_SHARED, _ADOPTED):
            return self._receive_shared(position, numel, getattr(torch, dtype), entries, verify, kind == _ADOPTED)
        else:
            buffer = self._buffer(position, numel, getattr(torch, dtype))
            self.group.broadcast(buffer)
        return FlatBucket(buffer, tuple(HFSlot(*e) for e in entries)), self._checksums(len(entries), verify)

    def _receive_shared(self, position: int, numel: int, dtype: torch.dtype, entries, verify: bool, adopted: bool):
        """A bucket the sender left in shared memory: its place and checksums; the sender's buffer mapped here
        (acknowledged once the engine asks for the next bucket; an `adopted` one, kept for its position and
        taken as the engine's parameters, never), or copied into one of this side's own for an engine that
        keeps or passes on its buckets (acknowledged at once)."""
        message, unmapped = torch.empty(PLACE_BYTES + (8 * len(entries) if verify else 0), dtype=torch.uint8), None
        self.group.broadcast(message)  # the place, then the checksums (`verify`)
        place, expected = message[:PLACE_BYTES], message[PLACE_BYTES:].view(torch.int64) if verify else None
        try:
            buffer = self._peers.open(place, numel, dtype)
        except OSError as err:  # another user's process, say: /proc/<pid>/fd is not ours to open
            unmapped = err
        if unmapped is not None:
            self.group.sync_point()
            raise WeightUpdateError(
                f"could not map the trainer's shared-memory weight bucket ({unmapped}); construct the"
                " BroadcastSender with shm=False to broadcast over the weight group instead"
            ) from unmapped
        if adopted:
            return FlatBucket(buffer, tuple(HFSlot(*e) for e in entries), kept=True), expected
        if self._copies_shared:
            buffer = self._buffer(position, numel, dtype).copy_(buffer)
            self.group.sync_point()
        else:
            self._reading = True
        return FlatBucket(buffer, tuple(HFSlot(*e) for e in entries)), expected

    def _checksums(self, count: int, verify: bool) -> Optional[torch.Tensor]:
        """The sender's per-tensor checksums of the bucket (None without `verify`: none are sent)."""
        if not verify:
            return None
        expected = torch.empty(count, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(expected)
        return expected

    def _buffer(self, position: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a whole bucket lands: kept per position for an engine in another process, or for delta
        updates of 16-bit buckets (the next update may change only some of its elements); the one
        reused buffer for an engine that does not keep buckets (CPU); else fresh."""
        if self._delta and dtype in DELTA_DTYPES:
            held = self._held.get(position)
            if held is None or held.numel() != numel:
                held = self._held[position] = (
                    self._kept.take(("delta", position), numel, dtype, self.group.device)
                    if self._kept
                    else alloc_flat(numel, dtype, self.group.device)
                )
            return held
        if self._kept:
            return self._kept.take(position, numel, dtype, self.group.device)
        if self._ring is not None:
            return self._ring.take(numel, dtype, self.group.device)
        return alloc_flat(numel, dtype, self.group.device)


def _host_and_user(min_free_bytes: int = 0) -> Optional[str]:
    """This member's `shm.host_id` and user: a process of another user on the same host cannot open this one's
    shared memory through /proc/<pid>/fd (None: no id, `host_id`'s reasons)."""
    host = host_id(min_free_bytes=min_free_bytes)
    return None if host is None else f"{host}/uid={os.getuid()}"


def _checked_views(bucket: FlatBucket) -> list:
    """`bucket.tensors()` (its check first) with the bucket's CUDA device current (a Triton sum launches on the
    current device)."""
    if bucket.buffer.is_cuda:
        with torch.cuda.device(bucket.buffer.device):
            return bucket.tensors()
    return bucket.tensors()
