"""The weight-sync protocol: flat buckets travel as they are through every sender; no import circle.

Senders here feed real engines (the embedded `transformers` engine; vLLM's own IPC worker side is
in test_vllm_engine.py) with buckets of a real checkpoint; spies only record where tensors lie.
"""

import ast
import inspect
import itertools
import os
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from rollout_sync_checks import within
from safetensors.torch import load_file

from megarl.rollout import WeightUpdateError
from megarl.rollout.embedded import EmbeddedEngine
from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import bucket_tensors
from megarl.rollout.sharding.senders import InPlaceSender, sender_for
from megarl.testing.dist import free_port

ROLLOUT = Path(__file__).resolve().parents[2] / "megarl" / "rollout"


@pytest.fixture(scope="module")
def engine(rollout_models):
    return EmbeddedEngine(rollout_models["llama_other"])


@pytest.fixture(scope="module")
def checkpoint(rollout_models):
    return sorted(load_file(str(rollout_models["llama"] / "model.safetensors")).items())


def specs_of(weights):
    return [HFSpec(n, tuple(t.shape), t.dtype) for n, t in weights]


def no_cat():
    """Fail any torch.cat inside the block: buckets must travel without being flattened again."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.cat called while sending buckets")

    return mock.patch.object(torch, "cat", refuse)


def engine_equals(engine, weights):
    return all(torch.equal(engine._params[n], t) for n, t in weights)


def test_bucket_tensors_are_flat_contiguous_and_in_order(checkpoint):
    weights = checkpoint + [("extra.half", torch.ones(3, dtype=torch.float16))]
    buckets = list(bucket_tensors(weights, 100_000))
    assert len(buckets) > 3 and buckets[-1].dtype == torch.float16
    got = [(n, t) for b in buckets for n, t in b.tensors()]
    assert [n for n, _ in got] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, weights))
    for b in buckets:
        assert b.buffer.is_contiguous() and b.buffer.numel() == sum(e.numel for e in b.entries)
        assert b.buffer.numel() * b.buffer.element_size() <= 100_000 or len(b.entries) == 1


def straddling_bucket(dtype, lead: int, generator):
    """A bucket of odd shapes whose tensors straddle words, over random words (their sums wrap), starting
    `lead` elements into its first word and ending in a partial word. (Also run in a fresh interpreter by
    the Triton test, which takes this function's source.)"""
    import torch

    from megarl.rollout.sharding.plan import HFSlot
    from megarl.rollout.sharding.protocol import FlatBucket

    itemsize = torch.empty((), dtype=dtype).element_size()
    shapes = [(3,), (5, 7), (1,), (2, 2, 3), (11,), (4, 1), (9, 9)]
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    words = torch.randint(-(2**62), 2**62, (numel + lead,), dtype=torch.int64, generator=generator)
    buffer = words.view(torch.uint8)[: (numel + lead) * itemsize].view(dtype)[lead:]
    entries, offset = [], 0
    for i, shape in enumerate(shapes):
        entries.append(HFSlot(f"t{i}", shape, offset))
        offset += torch.Size(shape).numel()
    return FlatBucket(buffer, tuple(entries))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_checksums_from_block_sums_equal_the_per_tensor_sums(dtype):
    """The GPU form of `protocol.checksums` (block sums and prefix sums, `_blocked_sums`) equals the CPU form
    (a sum per tensor) on buckets whose tensors straddle words and blocks, whose buffer starts off a word
    boundary and ends in a partial word, and whose words overflow int64 (the sums wrap)."""
    import functools

    from megarl.rollout.sharding import protocol

    generator = torch.Generator().manual_seed(0)
    for lead, block in itertools.product(range(4), (1, 3, 8, 1 << 12)):
        bucket = straddling_bucket(dtype, lead, generator)
        blocked = functools.partial(protocol._blocked_sums, block=block)
        with mock.patch.object(protocol, "_looped_sums", blocked):
            from_blocks = protocol.checksums(bucket)
        assert torch.equal(from_blocks, protocol.checksums(bucket)), (lead, block)
        changed = bucket.buffer.clone()
        changed.view(torch.uint8)[-1] ^= 1  # the last byte: in the buffer's partial last word
        with mock.patch.object(protocol, "_looped_sums", blocked):
            assert not torch.equal(protocol.checksums(protocol.FlatBucket(changed, bucket.entries)), from_blocks)


_TRITON_SUMS_CHECK = """  # after `straddling_bucket`'s source
import itertools
from unittest import mock
import torch
from megarl.rollout.sharding import devicesum, protocol

assert devicesum.available(torch.device("cpu"))
devicesum.PIECE, devicesum.BLOCK = 5, 2  # spans of several pieces, pieces of several loop steps
generator = torch.Generator().manual_seed(0)
for dtype, lead in itertools.product((torch.bfloat16, torch.float32, torch.int8), range(4)):
    bucket = straddling_bucket(dtype, lead, generator)
    with mock.patch.object(protocol, "_looped_sums", devicesum.span_sums):
        from_kernel = protocol.checksums(bucket)
        changed = bucket.buffer.clone()
        changed.view(torch.uint8)[-1] ^= 1
        assert not torch.equal(protocol.checksums(protocol.FlatBucket(changed, bucket.entries)), from_kernel)
    assert torch.equal(from_kernel, protocol.checksums(bucket)), (dtype, lead)
print("ok", len(devicesum._TABLES))
"""


def test_checksums_from_the_triton_kernel_equal_the_per_tensor_sums():
    """The GPU's one-launch form of `protocol.checksums` (`devicesum.span_sums`: spans cut into pieces, each
    piece summed by one Triton program and added into its tensor's sum) equals the CPU form, run by Triton's
    interpreter on CPU tensors (in a fresh interpreter: TRITON_INTERPRET is read when the kernel is defined)
    on buckets whose tensors straddle words and pieces, off a word boundary, with wrapping sums."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    script = inspect.getsource(straddling_bucket) + _TRITON_SUMS_CHECK
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "3"]  # a device table per bucket layout: one per dtype, whatever the lead


def test_gpu_checksums_fall_back_to_block_sums_when_the_kernel_fails(monkeypatch, caplog):
    """A Triton kernel that fails to build or run (a GPU Triton does not support) is logged once and not tried
    again; the checksums come from block sums, the same values."""
    from megarl.rollout.sharding import devicesum, protocol

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # `available` then accepts CPU tensors
    monkeypatch.setattr(devicesum, "_FAILED", {})
    calls = []

    def failing(words, spans):
        calls.append(1)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_61")

    monkeypatch.setattr(devicesum, "span_sums", failing)
    words = torch.randint(-(2**62), 2**62, (1000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    spans = [(0, 800), (800, 3001), (3001, 8000)]
    assert devicesum.available(words.device)
    with caplog.at_level("WARNING", logger=devicesum.__name__):
        for _ in range(2):
            assert torch.equal(protocol._gpu_sums(words, spans), protocol._looped_sums(words, spans))
    assert len(calls) == 1 and not devicesum.available(words.device)
    assert "sm_61" in caplog.text
    assert devicesum.available(words.device, "piece_copy_sums")  # the pack's kernel is still tried


def test_in_place_sender_streams_views_of_each_bucket(engine, checkpoint, monkeypatch):
    buckets = list(bucket_tensors(checkpoint, 200_000))
    seen = []
    original = engine.load_checked
    monkeypatch.setattr(
        engine, "load_checked", lambda items, v: original(((n, seen.append(t) or t, c) for n, t, c in items), v)
    )
    sender = sender_for(engine)  # copies each view in (with adopt=True: test_embedded_engine)
    assert isinstance(sender, InPlaceSender) and not sender.keeps_buffers and sender.adopt_into is None
    sender.check(specs_of(checkpoint))
    with no_cat():
        assert sender.send(buckets, 7) == 7 == engine.version
    assert engine_equals(engine, checkpoint)
    assert len(seen) == len(checkpoint) and all(within(t, [b.buffer for b in buckets]) for t in seen)  # no copy


def test_rejected_update_loads_nothing_and_keeps_the_version(engine, checkpoint):
    sender = sender_for(engine)
    before = {n: t.clone() for n, t in engine._params.items()}
    version = engine.version
    bad = checkpoint[:3] + [("model.norm.weight", torch.ones(7))]
    with pytest.raises(WeightUpdateError, match="'model.norm.weight' with shape \\(7,\\)"):
        sender.check(specs_of(bad), partial=True)
    with pytest.raises(RuntimeError, match="check"):  # nothing announced: send refuses
        sender.send(bucket_tensors(bad), version + 1)
    sender.check(specs_of(checkpoint[:2]), partial=True)
    with pytest.raises(WeightUpdateError, match="was not announced"):
        sender.send(bucket_tensors(checkpoint[2:3]), version + 1)
    assert engine.version == version and all(torch.equal(engine._params[n], t) for n, t in before.items())


def test_ipc_buckets_are_shared_by_handle_not_copied(checkpoint):
    """The receiving side maps the sender's own buffers: its writes show in them, nothing was moved."""
    from megarl.rollout.sharding.ipc import IpcSender, connect_worker, receive_buckets, serve_buckets

    sender = IpcSender(engine=None)
    buckets = list(bucket_tensors(checkpoint, 200_000, shared=sender.shares_buffers))
    pointers = [b.buffer.data_ptr() for b in buckets]
    received = []

    def worker():
        with connect_worker(sender.address, sender.authkey) as conn:
            for bucket in receive_buckets(conn):
                received.append([(n, t.clone()) for n, t in bucket.tensors()])
                bucket.buffer.fill_(-1.0)
        return len(received)

    with no_cat():
        assert serve_buckets(sender.address, sender.authkey, buckets, worker) == len(buckets)
    assert [n for b in received for n, _ in b] == [n for n, _ in checkpoint]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip((x for b in received for x in b), checkpoint))
    assert [b.buffer.data_ptr() for b in buckets] == pointers  # not moved into shared memory on the way
    assert all(bool((b.buffer == -1.0).all()) for b in buckets)  # the worker wrote into the same memory


def weight_groups() -> dict:
    """Rank 0 (sender) and rank 1 (receiver) of a gloo weight group, in this process."""
    from megarl.rollout.sharding.broadcast import WeightGroup

    port, groups = free_port(), {}
    joins = [
        threading.Thread(target=lambda r=r: groups.__setitem__(r, WeightGroup("127.0.0.1", port, r, 2, timeout_s=60)))
        for r in (0, 1)
    ]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    return groups


def receiving(receiver) -> tuple[threading.Thread, dict]:
    """`receiver.receive_update()` on a thread; its result (or error) lands in the dict."""

    def run():
        try:
            result["v"] = receiver.receive_update()
        except Exception as err:  # noqa: BLE001 -- the test looks at it
            result["error"] = err

    result: dict = {}
    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


@pytest.mark.parametrize("shm", [False, True])
def test_broadcast_sender_broadcasts_each_bucket_buffer_as_it_is(rollout_models, checkpoint, shm, monkeypatch):
    """Over the group's TCP each bucket's buffer is broadcast as it is; with every member on this host (`shm`)
    no byte of a bucket is broadcast: the receiver maps the sender's shared buffer (once, for both updates)
    and the sender copies nothing into a staging buffer. Either way the engine ends bit-identical and each
    bucket's layout crosses once."""
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    receiver_engine = EmbeddedEngine(rollout_models["llama_other"])
    receiver = BroadcastReceiver(groups[1], receiver_engine)
    sender = BroadcastSender(groups[0], shm=shm, adopt=False)  # the test's own buckets, not in `adopt_into`
    broadcast, objects, mapped = [], [], []
    send_tensor, send_object, from_file = groups[0].broadcast, groups[0].broadcast_object, torch.from_file
    groups[0].broadcast = lambda tensor, src=0, **kw: (
        broadcast.append((tensor.data_ptr(), tensor.dtype)),
        send_tensor(tensor, src, **kw),
    )[1]
    groups[0].broadcast_object = lambda obj=None, src=0: (objects.append(obj), send_object(obj, src))[1]
    monkeypatch.setattr(torch, "from_file", lambda *a, **kw: mapped.append(a[0]) or from_file(*a, **kw))
    buckets = list(bucket_tensors(checkpoint, 200_000, shared=shm))
    for version in (4, 5, None):
        thread, result = receiving(receiver)
        if version is None:
            sender.close()
        else:
            sender.check(specs_of(checkpoint))
            with no_cat():
                assert sender.send(buckets, version) == version
            sent = {ptr for ptr, _ in broadcast}
            assert all((b.buffer.data_ptr() in sent) != shm for b in buckets)  # each buffer as it is, or none
        thread.join(timeout=60)
        assert result["v"] == version and (version is None or version == receiver_engine.version)
    assert engine_equals(receiver_engine, checkpoint)
    layouts = [o for o in objects if isinstance(o, tuple)]
    assert len(layouts) == len(buckets)  # bucket layouts crossed once, not once per update
    assert sender.shares_buffers == shm and sender.sent_bytes == sum(b.buffer.nbytes for b in buckets)
    if shm:
        assert {dtype for _, dtype in broadcast} <= {torch.int64, torch.uint8}  # control, places, checksums
        assert len(mapped) == len(buckets) and sender._staging.buffers == [None]


def test_a_shared_memory_broadcast_reuses_the_senders_buffer_only_after_the_engine_copied_it(
    rollout_models, checkpoint, monkeypatch
):
    """By shared memory, buckets that do not live there cross through one staging buffer of the sender's: a
    slow engine has copied bucket k (each tensor checked as it is copied, bucket 0 whole first) before the
    sender writes bucket k+1 into that buffer; the engine ends bit-identical."""
    from megarl.rollout.sharding import copysum
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"])
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0], adopt=False)
    buckets = list(bucket_tensors(checkpoint, 200_000))
    bucket_of = {e.name: i for i, b in enumerate(buckets) for e in b.entries}
    events, load, share = [], engine.load_checked, sender._share_bucket

    def loading(items):
        for name, tensor, check in items:
            if name == buckets[bucket_of[name]].entries[0].name:
                time.sleep(0.05)  # a slow engine
            yield name, tensor, check
            events.append(("pending" if check is not None else "passed", bucket_of[name]))
            if name == buckets[bucket_of[name]].entries[-1].name:
                events.append(("loaded", bucket_of[name]))

    def sharing(position, bucket):
        events.append(("staged", position))
        share(position, bucket)

    monkeypatch.setattr(engine, "load_checked", lambda items, version: load(loading(items), version))
    monkeypatch.setattr(sender, "_share_bucket", sharing)
    thread, result = receiving(receiver)
    sender.check(specs_of(checkpoint))
    assert sender.send(buckets, 3) == 3
    thread.join(timeout=60)
    assert result["v"] == 3 and engine_equals(engine, checkpoint)
    assert len(buckets) > 2 and len(sender._staging.buffers) == 1  # every bucket through the same buffer
    at = {event: i for i, event in enumerate(events)}
    assert all(at["loaded", k] < at["staged", k + 1] for k in range(len(buckets) - 1))
    assert {k for kind, k in events if kind == "passed"} == {0}
    if copysum.available():
        assert {k for kind, k in events if kind == "pending"} == set(range(1, len(buckets)))


@pytest.mark.parametrize("why", ["another host", "another user", "a small /dev/shm"])
def test_a_group_with_a_member_on_another_host_broadcasts_over_tcp(rollout_models, checkpoint, monkeypatch, why):
    """The host ids differ (another machine, or a container with a /dev/shm of its own), a member runs as
    another user (it could not open the sender's /proc/<pid>/fd), or the sender's /dev/shm has no room for the
    sharding manager's shared rings (a container's default 64 MiB): the sender keeps the TCP broadcast, probed
    once, and the engine ends bit-identical."""
    from megarl.rollout.sharding import broadcast as bc
    from megarl.rollout.sharding import shm

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"])
    receiver, sender = bc.BroadcastReceiver(groups[1], engine), bc.BroadcastSender(groups[0])
    probes, host_id = [], shm.host_id
    if why == "another host":
        hosts = iter(["here", "there"])
        monkeypatch.setattr(bc, "host_id", lambda **kw: probes.append(1) or next(hosts))
    elif why == "another user":
        main = threading.main_thread()  # the sender's; the receiver's runs on a thread of its own
        monkeypatch.setattr(bc.os, "getuid", lambda: 1000 if threading.current_thread() is main else 1001)
        monkeypatch.setattr(bc, "host_id", lambda **kw: probes.append(1) or host_id(**kw))
    else:
        monkeypatch.setattr(shm, "free_bytes", lambda: 64 << 20)
        monkeypatch.setattr(bc, "host_id", lambda **kw: probes.append(1) or host_id(**kw))
    for version in (1, 2):
        thread, result = receiving(receiver)
        assert sender.update(checkpoint, version) == version
        thread.join(timeout=60)
        assert result["v"] == version and not sender.shares_buffers and engine_equals(engine, checkpoint)
    assert len(probes) == 2  # one id from each member, at the first update only


def test_a_broadcast_receiver_takes_each_bucket_one_ahead_and_checks_each_tensor_as_it_copies_it(
    rollout_models, checkpoint, monkeypatch
):
    """The in-process engine's buckets are received on a thread of their own, one ahead: bucket k+1 arrives
    while a slow engine loads bucket k, bucket k+2 only after bucket k was loaded (its buffer is reused).
    Bucket 0 is checked whole before any of it is loaded; every later tensor is summed as it is copied
    (`copysum`, where it is built), not read once more before; the engine ends bit-identical."""
    from megarl.rollout.sharding import copysum, protocol
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"])
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0], shm=False)
    buckets = list(bucket_tensors(checkpoint, 200_000))
    bucket_of = {e.name: i for i, b in enumerate(buckets) for e in b.entries}
    events, threads, fused = [], set(), []
    receive, sums, load, copy_sum = groups[1].broadcast, protocol.checksums, engine.load_checked, copysum.copy_sum

    def received(tensor, src=0):
        receive(tensor, src)
        if tensor.is_floating_point():
            threads.add(threading.current_thread().name)
            events.append(("received", sum(e[0] == "received" for e in events)))

    def checked(bucket):
        got = sums(bucket)
        events.append(("checked", bucket_of[bucket.entries[0].name]))
        return got

    def loading(items):
        seen = set()
        for name, tensor, check in items:
            if bucket_of[name] not in seen:
                seen.add(bucket_of[name])
                events.append(("loading", bucket_of[name]))
                time.sleep(0.05)  # a slow engine: the next bucket arrives before this one is copied
            events.append(("pending" if check is not None else "passed", bucket_of[name]))
            yield name, tensor, check
            if name == buckets[bucket_of[name]].entries[-1].name:
                events.append(("loaded", bucket_of[name]))

    groups[1].broadcast = received
    monkeypatch.setattr(protocol, "checksums", checked)
    monkeypatch.setattr(copysum, "copy_sum", lambda dst, words: fused.append(dst.shape) or copy_sum(dst, words))
    monkeypatch.setattr(engine, "load_checked", lambda items, version: load(loading(items), version))
    thread, result = receiving(receiver)
    sender.check(specs_of(checkpoint))
    assert sender.send(buckets, 3) == 3
    thread.join(timeout=60)
    assert result["v"] == 3 and engine_equals(engine, checkpoint)
    assert len(buckets) > 2 and threads == {"megarl-bucket-receive"}  # the receives (checks: the engine's side)
    at = {event: i for i, event in enumerate(events)}
    assert at["checked", 0] < at["loading", 0]
    assert {k for kind, k in events if kind == "passed"} == {0}  # bucket 0's tensors come checked
    assert {k for kind, k in events if kind == "pending"} == set(range(1, len(buckets)))
    if copysum.available():  # later buckets: no separate read, each tensor summed as it is copied
        assert {k for kind, k in events if kind == "checked"} == {0}
        assert len(fused) == sum(len(b.entries) for b in buckets)  # bucket 0's, checked already: `copy_into`
    for k in range(len(buckets)):
        if k + 1 < len(buckets):
            assert at["received", k + 1] < at["loaded", k]
        if k + 2 < len(buckets):
            assert at["loaded", k] < at["received", k + 2]


@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize("corrupt", [0, 2])
def test_a_bucket_corrupted_on_the_way_fails_the_broadcast_update_naming_its_tensor(
    rollout_models, checkpoint, corrupt, shm
):
    """One bit of the `corrupt`-th bucket flips on the receiver's side (as it arrives over TCP, or in the
    sender's shared buffer the receiver mapped): the update fails on both sides naming the tensor, the engine
    keeps its version (bucket 0: nothing was loaded, it keeps serving; later: it refuses requests until an
    update succeeds), and the group stays in step for the next update."""
    from megarl.rollout.sharding import copysum
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"])
    before = [(n, t.clone()) for n, t in engine._params.items()]
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0], shm=shm, adopt=False)
    buckets = list(bucket_tensors(checkpoint, 200_000))
    assert len(buckets) > corrupt
    receive, open_shared, seen = groups[1].broadcast, receiver._peers.open, []

    def flip(tensor):
        if len(seen) == corrupt:
            tensor.view(torch.uint8)[-1] ^= 1  # the bucket's last tensor
        seen.append(tensor.numel())

    def flipping(tensor, src=0):
        receive(tensor, src)
        if tensor.is_floating_point():  # a bucket's buffer (control messages and checksums are int64)
            flip(tensor)

    def flipping_shared(*args):
        mapped = open_shared(*args)
        flip(mapped)
        return mapped

    groups[1].broadcast = flipping
    receiver._peers.open = flipping_shared
    thread, result = receiving(receiver)
    sender.check(specs_of(checkpoint))
    name = buckets[corrupt].entries[-1].name
    with pytest.raises(
        WeightUpdateError, match=rf"engine server 1: WeightUpdateError: .*{name!r}.*checksum mismatch"
    ) as info:
        sender.send(buckets, 7)
    if corrupt > 0 and copysum.available():  # found as the tensor was copied: no read of the bucket before
        assert "found as it was copied into the model" in str(info.value)
    thread.join(timeout=60)
    assert isinstance(result["error"], WeightUpdateError) and len(seen) == len(buckets)  # read to the end
    assert engine.version != 7
    if corrupt == 0:
        assert engine.broken is None and engine_equals(engine, before)
    else:
        assert "refuses requests" in engine.broken
    groups[1].broadcast, receiver._peers.open = receive, open_shared
    thread, result = receiving(receiver)
    sender.check(specs_of(checkpoint))
    assert sender.send(buckets, 8) == 8
    thread.join(timeout=60)
    assert result["v"] == 8 and engine.broken is None and engine_equals(engine, checkpoint)


def landed_for_adoption(into, checkpoint, on_write=lambda position: None):
    """The checkpoint's buckets as a sharding manager lands them for a sender that offers `adopt_into`: each
    written into the buffer kept for its position (`on_write` is called before the write)."""
    from dataclasses import replace

    for position, bucket in enumerate(bucket_tensors(checkpoint, 200_000)):
        on_write(position)
        kept = into.take(position, bucket.buffer.numel(), bucket.dtype, "cpu").copy_(bucket.buffer)
        yield replace(bucket, buffer=kept, kept=True)


def test_a_same_host_broadcast_lands_in_memory_the_engine_takes_as_its_parameters(rollout_models, checkpoint):
    """An engine in its receiver's process takes the sender's kept shared memory as its parameters: the first
    sync rebinds them, later syncs are written straight into the model (its parameters stay where they are and
    hold each update bit for bit), never before the engine holds its weights lock, and the sender does not
    wait for the engine bucket by bucket (no sync point)."""
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"])
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0])
    locked, syncs, where = [], [], None
    groups[0].sync_point = lambda sync=groups[0].sync_point: (syncs.append(1), sync())
    for version, weights in ((1, checkpoint), (2, [(n, t + 1) for n, t in checkpoint])):
        thread, result = receiving(receiver)
        sender.check(specs_of(weights))
        assert sender.adopt_into is not None  # every receiver's engine can adopt
        into, syncs[:] = sender.adopt_into, []
        buckets = landed_for_adoption(into, weights, lambda _: locked.append(engine._weights_lock.locked()))
        assert sender.send(buckets, version) == version
        thread.join(timeout=60)
        assert result["v"] == version and engine_equals(engine, weights)
        assert len(syncs) == 1  # the update's start (the engine holds its lock), none per bucket
        if where is None:
            where = {n: p.data_ptr() for n, p in engine._params.items()}
    assert all(locked) and len(locked) > 2
    assert {n: p.data_ptr() for n, p in engine._params.items()} == where  # written in place at the second sync
    mapped = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in receiver._peers._opened.values()]
    assert all(any(lo <= ptr < hi for lo, hi in mapped) for ptr in where.values())  # the sender's memory


def test_an_adopted_bucket_corrupted_in_the_model_fails_the_update_and_the_engine_refuses_requests(
    rollout_models, checkpoint
):
    """One bit of an adopted bucket flips after the trainer wrote it (in the engine's parameters): the update
    fails on both sides naming the tensor, the engine refuses requests (its weights may mix two versions) until
    an update succeeds, and the group stays in step for it."""
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"])
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0])
    open_shared, opened = receiver._peers.open, []

    def flipping(*args):
        mapped = open_shared(*args)
        if len(opened) == 1:
            mapped.view(torch.uint8)[-1] ^= 1  # bucket 1's last tensor
        opened.append(mapped)
        return mapped

    receiver._peers.open = flipping
    thread, result = receiving(receiver)
    sender.check(specs_of(checkpoint))
    buckets = list(bucket_tensors(checkpoint, 200_000))
    name = buckets[1].entries[-1].name
    with pytest.raises(WeightUpdateError, match=rf"engine server 1: WeightUpdateError: .*{name!r}.*checksum mismatch"):
        sender.send(landed_for_adoption(sender.adopt_into, checkpoint), 5)
    thread.join(timeout=60)
    assert isinstance(result["error"], WeightUpdateError) and len(opened) == len(buckets)  # read to the end
    assert engine.version != 5 and "refuses requests" in engine.broken
    receiver._peers.open = open_shared
    thread, result = receiving(receiver)
    sender.check(specs_of(checkpoint))
    assert sender.send(landed_for_adoption(sender.adopt_into, checkpoint), 6) == 6
    thread.join(timeout=60)
    assert result["v"] == 6 and engine.broken is None and engine_equals(engine, checkpoint)


@pytest.mark.parametrize("case", ["tcp", "partial", "adopt=False", "MEGARL_ADOPT_WEIGHTS=0", "engine cannot"])
def test_a_broadcast_offers_adoption_only_where_every_engine_can_take_it(rollout_models, checkpoint, case, monkeypatch):
    """No adoption over TCP, for a partial update, when turned off, or where an engine cannot adopt the
    tensors: the sender's `adopt_into` stays None and the engine copies each bucket in."""
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    if case == "MEGARL_ADOPT_WEIGHTS=0":
        monkeypatch.setenv("MEGARL_ADOPT_WEIGHTS", "0")
    engine = EmbeddedEngine(rollout_models["llama_other"])
    if case == "engine cannot":
        monkeypatch.setattr(engine, "adopts_update", lambda specs: False)
    groups = weight_groups()
    kwargs = {"tcp": {"shm": False}, "adopt=False": {"adopt": False}}.get(case, {})
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0], **kwargs)
    weights = checkpoint[:2] if case == "partial" else checkpoint
    thread, result = receiving(receiver)
    sender.check(specs_of(weights), partial=case == "partial")
    assert sender.adopt_into is None and sender.shares_buffers == (case != "tcp")
    assert sender.send(bucket_tensors(weights, 200_000, shared=sender.shares_buffers), 3) == 3
    thread.join(timeout=60)
    assert result["v"] == 3 and engine_equals(engine, weights)
    mapped = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in receiver._peers._opened.values()]
    assert not any(lo <= p.data_ptr() < hi for p in engine._params.values() for lo, hi in mapped)  # copied in


def adamw_step(weights, lr: float):
    """The bf16 weights after one real AdamW step on fp32 masters (the loss pulls every weight to 0)."""
    params = [torch.nn.Parameter(t.float()) for _, t in weights]
    optimizer = torch.optim.AdamW(params, lr=lr)
    sum((p * p).sum() for p in params).backward()
    optimizer.step()
    return [(n, p.detach().to(torch.bfloat16)) for (n, _), p in zip(weights, params)]


def test_delta_broadcast_sends_only_the_changed_elements_and_the_engine_equals_a_full_sync(rollout_models, checkpoint):
    from megarl.rollout.sharding.broadcast import BroadcastReceiver, BroadcastSender

    groups = weight_groups()
    engine = EmbeddedEngine(rollout_models["llama_other"], dtype=torch.bfloat16)
    receiver, sender = BroadcastReceiver(groups[1], engine), BroadcastSender(groups[0], delta=True, shm=False)
    first = [(n, t.to(torch.bfloat16)) for n, t in checkpoint]
    dense = sum(t.numel() * 2 for _, t in first)
    updates = [first, adamw_step(first, lr=1e-5), adamw_step(first, lr=1e-5)]
    updates[2][0] = (updates[2][0][0], updates[2][0][1] + 1.0)  # one tensor changes everywhere
    updates += [first, updates[1]]  # with delta off, then on again: both sides still agree on what is held
    sent = []
    for version, weights in enumerate(updates, 1):
        sender.delta = version != 4
        thread, result = receiving(receiver)
        sender.check(specs_of(weights))
        assert sender.send(list(bucket_tensors(weights, 200_000)), version) == version
        thread.join(timeout=60)
        assert result["v"] == version and engine_equals(engine, weights)  # bit for bit, as a full sync
        sent.append(sender.sent_bytes)
    changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for (_, a), (_, b) in zip(*updates[:2]))
    assert 0 < changed < dense / 2 / 10  # most bf16 weights kept their bits at this learning rate
    assert sent[0] == dense and sent[1] == changed * 6  # int32 index + bf16 value per changed element
    assert sent[1] < sent[2] < dense  # the bucket holding the changed tensor went whole
    assert sent[3] == dense and sent[4] < dense


@pytest.mark.parametrize("numel, offset", [(1000, 0), (1001, 1)])
def test_a_delta_holds_exactly_the_changed_elements_until_it_would_not_be_smaller(numel, offset):
    from megarl.rollout.sharding.delta import changed_elements

    held = torch.randn(numel + offset).to(torch.bfloat16)[offset:]
    dense = numel * 2 / 6  # int32 index + bf16 value per change against 2 bytes per element

    def changed_at(positions):
        new = held.clone()
        new[positions] = new[positions] + 1.0
        return new

    for positions in (torch.tensor([3, 4, 5, numel - 1]), torch.arange(0, numel, 4)):  # a quarter: still smaller
        got = changed_elements(changed_at(positions), held)
        assert got is not None and got.dtype == torch.int32 and got.tolist() == positions.tolist()
    assert changed_elements(changed_at(torch.arange(int(dense) + 1)), held) is None  # indices + values not smaller
    assert changed_elements(held.clone(), held).numel() == 0


def loading_worker(sender, loaded: list):
    """A vLLM worker's side of IPC updates from `sender`: each bucket's tensor names go to `loaded` as they
    are taken (`FlatBucket.tensors`, which checks the bucket's checksums first)."""
    from megarl.rollout.sharding import ipc

    def worker():
        with ipc.connect_worker(sender.address, sender.authkey) as conn:
            for bucket in ipc.receive_buckets(conn):
                loaded.extend(n for n, _ in bucket.tensors())

    return worker


def test_an_ipc_bucket_changed_after_it_was_handed_over_is_refused_naming_its_tensor(checkpoint):
    """The trainer's side writes into a bucket's buffer after taking its checksums (a buffer reused too
    early): the worker refuses the bucket before loading any of it."""
    from megarl.rollout.sharding import ipc

    sender = ipc.IpcSender(engine=None)
    buckets = list(bucket_tensors(checkpoint, 200_000, shared=True))
    loaded = []
    worker = loading_worker(sender, loaded)

    def racing(bucket):
        sums = ipc_checksums(bucket)
        if bucket is buckets[1]:
            bucket.buffer[0] += 1.0  # the bucket's first tensor
        return sums

    ipc_checksums = ipc.checksums
    with mock.patch.object(ipc, "checksums", racing):
        with pytest.raises(WeightUpdateError, match=rf"{buckets[1].entries[0].name!r}.*checksum mismatch"):
            ipc.serve_buckets(sender.address, sender.authkey, buckets, worker)
    assert loaded == [e.name for e in buckets[0].entries]  # bucket 1 never reached the loader


def test_an_ipc_hop_passes_on_the_checksums_a_bucket_came_with_and_its_worker_checks_them(checkpoint):
    """An engine server's buckets arrive with the trainer's checksums (`verify_bucket`); its IPC hop to
    vLLM's workers sends those on instead of summing the bytes again (even with its own `verify` off), and
    a worker refuses a bucket whose bytes changed on the way, naming the tensor, before loading any of it."""
    from megarl.rollout.sharding import ipc, protocol

    sender = ipc.IpcSender(engine=None)
    buckets = list(bucket_tensors(checkpoint, 200_000, shared=True))
    arrived = [protocol.verify_bucket(b, protocol.checksums(b)) for b in buckets]
    buckets[1].buffer[-1] += 1.0  # changed after the trainer's sums: bucket 1's last tensor
    loaded = []
    worker = loading_worker(sender, loaded)

    def no_new_sums(bucket):
        raise AssertionError("the IPC hop summed a bucket that came with checksums")

    with mock.patch.object(ipc, "checksums", no_new_sums):
        with pytest.raises(WeightUpdateError, match=rf"{buckets[1].entries[-1].name!r}.*checksum mismatch"):
            ipc.serve_buckets(sender.address, sender.authkey, arrived, worker, verify=False)
    assert loaded == [e.name for e in buckets[0].entries]  # bucket 1 never reached the loader


def test_a_gpu_workers_bucket_hands_on_every_view_before_its_checksums_are_compared(checkpoint):
    """`FlatBucket.tensors_checked_after` (a GPU worker's loaders, `ipc.loader_tensors`): every view comes
    first, the sums are compared when the loader asks past the last one, and a changed byte then fails the
    update as one found in the model, naming its tensor; an intact bucket ends quietly. On CPU the worker
    still checks first: nothing of a corrupted bucket is handed on."""
    from megarl.rollout.sharding import ipc, protocol

    bucket = next(iter(bucket_tensors(checkpoint, 200_000)))
    received = protocol.verify_bucket(bucket, protocol.checksums(bucket))
    assert [n for n, _ in received.tensors_checked_after()] == [e.name for e in bucket.entries]
    bucket.buffer[-1] += 1.0  # its last tensor changes after the sender's sums
    taken = received.tensors_checked_after()
    views = [next(taken) for _ in bucket.entries]
    assert [n for n, _ in views] == [e.name for e in bucket.entries] and views[-1][1].data_ptr() != 0
    name = bucket.entries[-1].name
    with pytest.raises(WeightUpdateError, match=rf"{name!r}.*checksum mismatch.*found as it was copied into the model"):
        next(taken)
    with pytest.raises(WeightUpdateError, match=rf"{name!r}.*nothing of the bucket was loaded"):
        next(ipc.loader_tensors(received))


def test_a_gpu_workers_loader_refusing_a_corrupted_bucket_fails_the_update_with_the_checksum_error(monkeypatch):
    """A GPU worker hands vLLM's loaders a bucket's views before it compares the bucket's sums (`ipc.loader_tensors`).
    A loader that refuses the corrupted values itself (as a quantization scale's range check may) must not hide
    what happened: the update fails with the checksum mismatch naming the tensor, the loader's error its cause.
    A loader failing on an intact bucket keeps its own error. A fake worker over a pipe, the GPU form on CPU."""
    from multiprocessing import Pipe

    from megarl.rollout.sharding import ipc, protocol
    from megarl.rollout.sharding.plan import HFSlot

    monkeypatch.setattr(ipc, "loader_tensors", lambda bucket: bucket.tensors_checked_after())

    def refusing_loader(weights_iterator):
        for name, tensor in weights_iterator:
            if tensor.abs().max() > 100:
                raise RuntimeError(f"{name}: a value out of range")

    entries = (HFSlot("a", (2,), 0), HFSlot("b", (2,), 2))
    for corrupted in (True, False):
        memory = torch.randn(4)
        if not corrupted:
            memory[3] = 1000.0  # the trainer sent it so: the sums agree
        sums = protocol.checksums(protocol.FlatBucket(memory, entries)).tolist()
        memory[3] = 1000.0  # after the sums, where corrupted
        worker_end, sender_end = Pipe()
        sender_end.send((None, 0, (0, 4, torch.float32), entries, None, sums, True))
        worker = ipc.MegarlWorkerExtension()
        worker._megarl_in_place = lambda: None
        worker.reload_weights = refusing_loader
        worker._megarl_channel = lambda address, authkey, conn=worker_end, memory=memory: (
            conn,
            {0: memory.view(torch.uint8)},
        )
        if corrupted:
            with pytest.raises(WeightUpdateError, match=r"'b'.*checksum mismatch.*found as it was copied") as failed:
                worker.megarl_reload_by_ipc("address", b"key")
            assert "out of range" in str(failed.value.__cause__)
        else:
            with pytest.raises(RuntimeError, match="b: a value out of range"):
                worker.megarl_reload_by_ipc("address", b"key")

    # a bucket checked and acknowledged is not checked again: its sender may reuse the memory at once
    class Reusing:  # the worker's end; the sender writes other bytes into the bucket once it hears "ok"
        def __init__(self, conn):
            self.conn = conn

        def recv(self):
            return self.conn.recv()

        def send(self, message):
            memory.add_(1.0)
            self.conn.send(message)

        def close(self):
            self.conn.close()

    memory = torch.randn(4)
    worker_end, sender_end = Pipe()
    sums = protocol.checksums(protocol.FlatBucket(memory, entries)).tolist()
    sender_end.send((None, 0, (0, 4, torch.float32), entries, None, sums, True))
    worker.reload_weights = lambda weights_iterator: list(weights_iterator)
    worker._megarl_channel = lambda address, authkey: (Reusing(worker_end), {0: memory.view(torch.uint8)})
    sender_end.close()  # and then the sender goes: the update fails on the connection, not on a checksum
    with pytest.raises((EOFError, OSError)):
        worker.megarl_reload_by_ipc("address", b"key")


def _rollout_imports(path: Path) -> set[str]:
    """megarl.rollout modules a file imports (anywhere in it, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megarl.rollout"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megarl.rollout"))
    return found


def test_no_import_circle_in_megarl_rollout():
    modules = {}
    for path in ROLLOUT.rglob("*.py"):
        parts = path.relative_to(ROLLOUT.parents[1]).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = _rollout_imports(path)
    assert "megarl.rollout.vllm_engine" not in modules["megarl.rollout.sharding.ipc"], "ipc.py imports vllm_engine.py"

    def cycle_from(module, stack):
        if module in stack:
            return stack[stack.index(module) :] + [module]
        for imported in modules.get(module, ()):
            found = cycle_from(imported, stack + [module])
            if found:
                return found
        return None

    cycles = [c for m in modules if (c := cycle_from(m, []))]
    assert not cycles, f"import circle: {' -> '.join(cycles[0])}"


def test_ipc_feeds_every_worker_of_a_tp_engine(checkpoint):
    """Rollout TP > 1: every vLLM worker connects to the one listener and takes every bucket."""
    from megarl.rollout.sharding.ipc import connect_worker, receive_buckets, serve_buckets

    buckets = list(bucket_tensors(checkpoint, 200_000, shared=True))
    address, authkey = f"/tmp/megarl-test-{free_port()}.sock", b"k" * 16
    received = {0: [], 1: []}

    def worker(rank):
        with connect_worker(address, authkey) as conn:
            for bucket in receive_buckets(conn):
                received[rank].extend((n, t.clone()) for n, t in bucket.tensors())

    def receive():  # what collective_rpc does: every worker runs the reload at once
        threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return "loaded"

    assert serve_buckets(address, authkey, buckets, receive, workers=2) == "loaded"
    for rank in (0, 1):
        assert [n for n, _ in received[rank]] == [n for n, _ in checkpoint]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received[rank], checkpoint))


def test_ipc_failures_end_the_update_on_both_sides(checkpoint):
    """An engine that fails before its workers connect does not leave the sender waiting; a worker
    that fails partway ends the sender's loop; a sender whose buckets fail ends the workers'."""
    from megarl.rollout.sharding.ipc import connect_worker, receive_buckets, serve_buckets
    from megarl.rollout.sharding.protocol import UpdateProgress

    address, authkey = f"/tmp/megarl-test-{free_port()}.sock", b"k" * 16
    buckets = list(bucket_tensors(checkpoint, 200_000, shared=True))

    def engine_asleep():
        raise RuntimeError("engine is asleep")

    progress = UpdateProgress()
    with pytest.raises(RuntimeError, match="asleep"):
        serve_buckets(address, authkey, iter(buckets), engine_asleep, progress=progress)
    assert not progress.touched  # nothing reached a worker

    def worker_fails_at_second_bucket():
        with connect_worker(address, authkey) as conn:
            for i, _ in enumerate(receive_buckets(conn)):
                if i == 1:
                    raise ValueError("reload failed")

    progress = UpdateProgress()
    with pytest.raises(ValueError, match="reload failed"):
        serve_buckets(address, authkey, iter(buckets), worker_fails_at_second_bucket, progress=progress)
    assert progress.touched

    def failing_buckets():
        yield buckets[0]
        raise OSError("trainer rank lost")

    def worker():
        with connect_worker(address, authkey) as conn:
            return sum(1 for _ in receive_buckets(conn))

    with pytest.raises(EOFError):  # the worker sees the sender go away (raised first: the receive side's error)
        serve_buckets(address, authkey, failing_buckets(), worker)


def test_update_failing_partway_stops_the_engine_until_an_update_succeeds(rollout_models, checkpoint):
    """A failure before any tensor reached the model: previous weights and version, requests go on.
    After one reached it: the version stays, in-flight requests end with their partial outputs
    (nothing lost) and new ones are refused with the reason, until a complete update succeeds."""
    import asyncio

    from rollout_api_checks import abort_state, midway

    from megarl.rollout import SamplingParams

    engine = EmbeddedEngine(rollout_models["llama_other"])
    sender = sender_for(engine)
    version, before = engine.version, {n: t.clone() for n, t in engine._params.items()}

    def failing(after):
        def buckets():
            for i, bucket in enumerate(bucket_tensors(checkpoint, 200_000)):
                if i == after:
                    raise OSError("trainer rank lost")
                yield bucket

        return buckets()

    sender.check(specs_of(checkpoint))
    with pytest.raises(OSError):
        sender.send(failing(0), version + 1)
    assert engine.version == version and engine.broken is None and not engine.paused
    assert all(torch.equal(engine._params[n], t) for n, t in before.items())

    async def request():
        if engine.broken:  # a retry: serve again first
            await asyncio.to_thread(engine.update_weights, before.items(), version=version)
        return await engine.generate([1, 5, 9], SamplingParams(temperature=0, max_tokens=200))

    async def failing_update():
        sender.check(specs_of(checkpoint))
        with pytest.raises(OSError):
            await asyncio.to_thread(sender.send, failing(2), version + 1)

    (partial,) = asyncio.run(midway(request, failing_update, abort_state))
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 200
    assert set(partial.versions) == {version}
    assert engine.version == version and "mixes two versions" in engine.broken
    with pytest.raises(RuntimeError, match="refuses requests until an update succeeds"):
        engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert engine.update_weights(checkpoint) == version + 1 and engine.broken is None
    assert engine_equals(engine, checkpoint) and engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_an_ipc_channel_is_kept_and_maps_a_kept_buffer_once(checkpoint):
    """Updates after the first reuse the workers' connections; a kept buffer crosses by handle once and
    by token after it (the worker reads the trainer's new bytes through its old mapping); a buffer that
    is not kept, or was replaced, crosses by handle; the worker drops mappings an update no longer uses."""
    import dataclasses

    from torch.multiprocessing import reductions

    from megarl.rollout.sharding import ipc

    channel = ipc.IpcChannel(f"/tmp/megarl-test-{free_port()}.sock", b"k" * 16)
    buckets = [dataclasses.replace(b, kept=True) for b in bucket_tensors(checkpoint, 200_000, shared=True)]
    worker_side: dict = {"mapped": {}}

    def worker():  # what MegarlWorkerExtension does: one connection and its mappings, kept
        if "conn" in worker_side:
            worker_side["conn"].send(ipc._HELLO)
        else:
            worker_side["conn"] = ipc.connect_worker(channel.address, channel.authkey)
        return [
            (n, t.clone())
            for b in ipc.receive_buckets(worker_side["conn"], worker_side["mapped"])
            for n, t in b.tensors()
        ]

    handles = []

    def counting(tensor):
        handles.append(tensor)
        return reduce_tensor(tensor)

    reduce_tensor = reductions.reduce_tensor
    with mock.patch.object(reductions, "reduce_tensor", counting):
        assert [n for n, _ in channel.serve(buckets, worker)] == [n for n, _ in checkpoint]
        assert len(handles) == len(buckets) and len(worker_side["mapped"]) == len(buckets)
        conns = list(channel.conns)
        for b in buckets:
            b.buffer.mul_(2.0)  # the next update's weights, written into the same buffers
        received = channel.serve(buckets, worker)
        assert channel.conns == conns and len(handles) == len(buckets)  # no new connection, no handle
        assert all(torch.equal(t, 2.0 * w) for (_, t), (_, w) in zip(received, checkpoint))

        replaced = [dataclasses.replace(buckets[0], buffer=buckets[0].buffer.clone().share_memory_())] + [
            dataclasses.replace(b, kept=False) for b in buckets[1:]
        ]
        received = channel.serve(replaced, worker)
        assert len(handles) == 2 * len(buckets)  # every buffer by handle again
        assert all(torch.equal(t, 2.0 * w) for (_, t), (_, w) in zip(received, checkpoint))
        assert len(worker_side["mapped"]) == 1  # only the replacement is still mapped

    def failing():
        raise RuntimeError("reload refused")

    with pytest.raises(RuntimeError, match="reload refused"):
        channel.serve(buckets, failing)
    assert channel.closed
    with pytest.raises(EOFError):  # the worker's kept connection ends with the channel
        worker_side["conn"].recv()


ON_EVERY_DEVICE = pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)


def run_benchmark(script: str, *args: str) -> str:
    """The stdout of `benchmarks/<script>` run with `args` (it fails the test where it exits non-zero)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(repo / "benchmarks" / script), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    ).stdout


@ON_EVERY_DEVICE
def test_the_device_ipc_benchmark_checks_pass(device):
    """`benchmarks/ipc_device.py`'s checks — verified syncs bit-identical, a corrupted bucket refused naming its
    tensor, the next update landing, an unverified sync into mapped buffers landing the weights still being
    written — pass over CUDA IPC where there is a GPU (`scripts/gpu_check.sh`, which CI cannot run) and over
    shared memory everywhere, so the benchmark does not rot between GPU sessions."""
    out = run_benchmark("ipc_device.py", "--device", device, "--quick", "--bucket-mb", "1", "--repeats", "1")
    assert "corrupted bucket refused" in out and "check passed" in out and "integrity check's share" in out, out
    if device == "cuda":  # the one-launch pack's own sums are checked too
        assert "corrupted bucket refused (pack sums)" in out, out


def test_the_ipc_benchmark_refuses_a_bucket_changed_after_the_packs_own_sums(monkeypatch):
    """The same benchmark with its one-launch pack (the GPU's, `devicesum.copy_sums`) run by Triton's interpreter
    on CPU: the buckets carry the sums the pack took as it wrote them, the channel reads none back (it would
    fail), and a bucket changed after its pack is refused naming its tensor."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = run_benchmark("ipc_device.py", "--device", "cpu", "--quick", "--bucket-mb", "1", "--repeats", "1")
    assert "corrupted bucket refused (pack sums)" in out and "check passed" in out, out


@ON_EVERY_DEVICE
def test_the_device_unpack_benchmark_checks_pass(device):
    """`benchmarks/unpack_device.py` (the rollout rank's unpack of TP-sharded buckets, for a GPU session to time):
    the buckets packed from every TP rank's shards unpack to the HF tensors bit for bit, at TP 2 and 4."""
    out = run_benchmark("unpack_device.py", "--device", device, "--quick", "--tp", "2", "4", "--repeats", "1")
    assert out.count("unpacked bit for bit") == 2 and "x of a copy" in out, out


@ON_EVERY_DEVICE
def test_the_device_sync_benchmark_checks_pass(device):
    """`benchmarks/sync_device.py` (the colocated in-process sync on one GPU, `scripts/gpu_check.sh`): its engine,
    zeroed first, holds the bridge's export bit for bit after a sync, after the next one (into the buffers it
    adopted) and after a sleep and wake-up; on CPU too, so the benchmark does not rot between GPU sessions."""
    out = run_benchmark("sync_device.py", "--device", device, "--quick", "--repeats", "1")
    assert "check passed" in out and "in-process" in out, out
    adopted = float(out.split("MiB of its parameters are the sync's buffers")[0].split()[-1])
    assert adopted > 0, out  # the engine took the sync's buckets as its parameters
    if device == "cuda":  # every bucket packed in one launch, with its checksums (checked against a read-back)
        taken, total = out.split(" buckets came with the pack's checksums")[0].split()[-3::2]
        assert taken == total, out
