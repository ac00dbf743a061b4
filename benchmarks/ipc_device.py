"""Benchmark + check: the IPC weight transport on a GPU (CUDA IPC handles), against a device copy.

    python benchmarks/ipc_device.py                  # on a CUDA machine: Qwen2-1.5B-shaped bf16 weights (3.1 GB)
    python benchmarks/ipc_device.py --device cpu --quick   # the same code over shared memory, seconds

What a colocated vLLM engine's sync does on a GPU, without vLLM (its worker's loaders are replaced by
one `param.copy_(view)` per tensor, which is what they do for an unfused, TP1 model): the trainer side
packs the weights into kept flat buckets (`protocol.bucket_tensors`, then each sync, as the sharding
manager's pack at TP1 on a GPU, one Triton launch a bucket that sums what it writes, `devicesum.copy_sums`;
without Triton a copy per tensor), `ipc.IpcChannel.serve` hands each bucket to an "engine" process
by handle (`reduce_tensor`: a CUDA IPC handle; kept buffers cross by handle once, then by token) with
its per-tensor checksums (the pack's, else `protocol.checksums` read back), and the engine process
(`ipc.receive_buckets`: maps the bucket, acks) copies every tensor into its own parameters, checking the
checksums as the worker does (`ipc.loader_tensors`: on a GPU compared after the copies were queued).

Checked before timing: after a verified sync the engine's parameters equal the weights bit for bit
(per-tensor sums of the 16-bit words, computed on both sides); a bucket changed after its checksum was
taken (read back by the channel, or, on a GPU, by the pack) fails the update naming its tensor, and the
next update (a new channel) succeeds; an unverified
sync into buffers the engine mapped earlier lands the new weights, with the copies into them still
queued on the GPU when the bucket is announced.

Timed (best of --repeats, alternating, each ending with the device synchronized on both sides):
  * copy            — one `dst.copy_(src)` of all the weights' bytes (the memory floor);
  * checksums       — `protocol.checksums` of every bucket (one read of the bytes; on a GPU one Triton
                      launch per bucket, `devicesum`);
  * pack            — the weights copied into the kept buckets (the trainer side's part of a sync);
    pack-per-tensor — the same a `copy_` per tensor;
  * ipc-unverified  — pack + serve without checksums; ipc — pack + serve with them (the pack's);
    ipc-sums-read-back — the same with the checksums read back after the pack, by the channel;
    ipc-check-first — `ipc` with the engine checking each bucket before it copies any of it (the worker's
                      check before 2026-11-28: on a GPU it waits for the sums before issuing the copies);
  * on a GPU, checksums-blocked / ipc-blocked-sums and checksums-per-tensor / ipc-per-tensor-sums — the
    same with the checksums' earlier GPU forms on both sides (`protocol._blocked_sums`: about ten kernels
    per bucket; `protocol._looped_sums`: a reduction per tensor).
Prints each one's GB/s and its ratio against `copy` (bytes/s), and the integrity check's share of the
verified sync (ipc / ipc-unverified - 1), with the sums read back, and per form.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from multiprocessing.connection import Connection
from typing import Optional
from unittest import mock

import torch
import torch.multiprocessing as mp

from megarl.rollout.sharding import devicesum, ipc, protocol
from megarl.rollout.sharding.protocol import WeightUpdateError, bucket_tensors, checksums


def qwen2_shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of a Qwen2 checkpoint: 1.5B's sizes (tied embeddings), or a tiny one."""
    vocab, hidden, inter, layers, kv = (1000, 256, 512, 2, 64) if quick else (151936, 1536, 8960, 28, 256)
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    return shapes + [("model.norm.weight", (hidden,))]


def word_sums(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum of its 16-bit words as int64 (on its device): equal sums ⇒ the same bits, for
    anything but a deliberate collision."""
    return torch.stack([t.contiguous().view(torch.int16).to(torch.int64).sum() for t in tensors.values()]).cpu()


def engine_process(shapes, dtype, device: str, control: Connection) -> None:
    """The "engine": its own parameters; per ("load", address, authkey) it receives one update over the
    channel (connecting anew when the address changed or the last update failed) and copies every tensor in."""
    params = {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes}
    forms = sums_forms()
    conn, address, mapped, check_first = None, None, {}, False
    while (message := control.recv())[0] != "stop":
        if message[0] == "sums":
            control.send(word_sums(params))
            continue
        if message[0] == "form":  # the checksums' form here too (`with_sums_form`)
            protocol._gpu_sums = forms[message[1]]
            continue
        if message[0] == "check-first":  # each bucket checked whole before its copies (the worker before)
            check_first = message[1]
            continue
        _, new_address, authkey = message
        try:
            if conn is None or new_address != address:
                conn, address, mapped = ipc.connect_worker(new_address, authkey), new_address, {}
            else:
                conn.send(ipc._HELLO)  # a kept connection announces every update
            for bucket in ipc.receive_buckets(conn, mapped):
                for name, tensor in bucket.tensors() if check_first else ipc.loader_tensors(bucket):
                    params[name].copy_(tensor)
            if device != "cpu":
                torch.cuda.synchronize()
            control.send(("ok", ""))
        except Exception as err:  # noqa: BLE001 - reported to the sender, which raises it
            if conn is not None:
                conn.close()
            conn, mapped = None, {}
            control.send(("error", f"{type(err).__name__}: {err}"))


class Trainer:
    """The sender's side: the weights, their kept buckets, the channel and the engine process."""

    def __init__(self, args):
        self.device = args.device
        dtype = torch.bfloat16
        shapes = qwen2_shapes(args.quick)
        generator = torch.Generator(device=self.device).manual_seed(0)
        self.weights = {
            name: torch.randn(shape, generator=generator, device=self.device).to(dtype) for name, shape in shapes
        }
        self.bytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        self.buckets = [
            dataclasses.replace(b, kept=True)
            for b in bucket_tensors(list(self.weights.items()), args.bucket_mb << 20, shared=self.device == "cpu")
        ]
        self.tables = self.copy_tables()
        self.flat = torch.empty(self.bytes // 2, dtype=dtype, device=self.device)
        self.flat_src = torch.randn(self.bytes // 2, device=self.device).to(dtype)
        context = mp.get_context("spawn")
        self.control, child = context.Pipe()
        self.process = context.Process(target=engine_process, args=(shapes, dtype, self.device, child), daemon=True)
        self.process.start()
        self.channel = None

    def sync(self, verify: bool, pack_sums: bool = True) -> None:
        """One update; `pack_sums`: the buckets carry the sums their one-launch pack took (GPU), else the channel
        reads them back (`protocol.checksums`), as it did for every bucket before that pack."""
        sums = self.pack()
        buckets = self.buckets
        if pack_sums and sums is not None:
            buckets = [dataclasses.replace(b, sums=s) for b, s in zip(self.buckets, sums)]
        if self.channel is None or self.channel.closed:
            self.channel = ipc.IpcChannel(ipc._fresh_address(), os.urandom(16))
        channel = self.channel

        def receive():
            self.control.send(("load", channel.address, channel.authkey))
            status, error = self.control.recv()
            if status != "ok":
                raise WeightUpdateError(error)

        channel.serve(buckets, receive, verify=verify)

    def sync_checked_first(self) -> None:
        """A verified sync whose engine checks each bucket whole before it copies any of it (on a GPU: waits for
        the sums, then issues the copies), as the vLLM worker did before `ipc.loader_tensors`."""
        self.control.send(("check-first", True))
        try:
            self.sync(verify=True)
        finally:
            self.control.send(("check-first", False))

    def pack(self) -> Optional[list[torch.Tensor]]:
        """The weights into the kept buckets: on a GPU one launch a bucket that sums what it writes per tensor
        (`devicesum.copy_sums`, as the sharding manager's pack does at TP 1), returning the sums; else a copy per
        tensor (None)."""
        if not self.tables:
            self.pack_per_tensor()
            return None
        return [
            devicesum.copy_sums(b.buffer.view(torch.int64), table, len(b.entries))
            for b, table in zip(self.buckets, self.tables)
        ]

    def pack_per_tensor(self) -> None:
        for bucket in self.buckets:
            for name, view in bucket.tensors():
                view.copy_(self.weights[name])

    def copy_tables(self) -> list:
        """Per bucket, `devicesum.copy_table` of its weights (each tensor whole, in 8-byte words); [] where the
        one-launch pack cannot run (no Triton or no GPU)."""
        if not devicesum.available(torch.device(self.device), "piece_copy_sums"):
            return []
        tables = []
        for bucket in self.buckets:
            size = bucket.buffer.element_size()
            assert bucket.buffer.data_ptr() % 8 == 0 and all((e.offset * size) % 8 == 0 for e in bucket.entries)
            assert (bucket.entries[-1].offset + bucket.entries[-1].numel) * size % 8 == 0
            segments = [
                (self.weights[e.name].data_ptr(), e.offset * size // 8, e.numel * size // 8, i)
                for i, e in enumerate(bucket.entries)
            ]
            tables.append(devicesum.copy_table(segments, bucket.buffer.device))
        return tables

    def engine_sums(self) -> torch.Tensor:
        self.control.send(("sums",))
        return self.control.recv()

    def close(self) -> None:
        self.control.send(("stop",))
        self.process.join(30)
        if self.channel is not None:
            self.channel.close()


def check(trainer: Trainer) -> None:
    """A verified sync lands bit for bit; a bucket changed after its checksums were taken fails the update
    naming its tensor; the next update succeeds."""
    trainer.sync(verify=True)
    assert torch.equal(trainer.engine_sums(), word_sums(trainer.weights)), "the engine's weights differ after a sync"
    target = trainer.buckets[len(trainer.buckets) // 2]
    refused(trainer, target, pack_sums=False)
    if trainer.tables:  # the sums the one-launch pack took
        refused(trainer, target, pack_sums=True)
    trainer.sync(verify=True)
    assert torch.equal(trainer.engine_sums(), word_sums(trainer.weights)), "the update after a refused one differs"
    check_unverified(trainer)
    print(
        "check passed: verified and unverified syncs are bit-identical; a corrupted bucket is refused, the next"
        " update lands"
    )


def refused(trainer: Trainer, target, pack_sums: bool) -> None:
    """A bucket changed after its checksums were taken (by the pack, or read back by the channel) fails the
    update, naming its first tensor."""
    real_checksums, real_pack = ipc.checksums, trainer.pack

    def racing(bucket):
        sums = real_checksums(bucket)
        if bucket.buffer.data_ptr() == target.buffer.data_ptr():
            bucket.buffer[0] += 1.0  # after the checksums: the bytes the engine maps are not the ones summed
        return sums

    def corrupting_pack():
        sums = real_pack()
        target.buffer[0] += 1.0
        return sums

    def not_read_back(bucket):
        raise AssertionError("the channel read checksums back where the pack's came with the bucket")

    ipc.checksums, trainer.pack = (not_read_back, corrupting_pack) if pack_sums else (racing, real_pack)
    try:
        trainer.sync(verify=True, pack_sums=pack_sums)
        raise AssertionError("a corrupted bucket was loaded")
    except WeightUpdateError as err:
        assert target.entries[0].name in str(err), err
        print(f"corrupted bucket refused ({'pack' if pack_sums else 'read-back'} sums): {err}")
    finally:
        ipc.checksums, trainer.pack = real_checksums, real_pack


def check_unverified(trainer: Trainer) -> None:
    """An unverified sync into buckets the engine has mapped already (they cross by token, without CUDA IPC's
    event) lands the new weights, not the last sync's, even with the copies into the buckets still queued on
    the GPU when the bucket is announced (behind a ~0.1 s sleep kernel: `ipc._written` must wait for them)."""
    trainer.sync(verify=False)
    for weight in trainer.weights.values():
        weight.add_(1.0)
    if trainer.device != "cpu":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles, before the pack's copies on the same stream
    trainer.sync(verify=False)
    assert torch.equal(trainer.engine_sums(), word_sums(trainer.weights)), (
        "an unverified sync into mapped buckets loaded bytes the trainer had not finished writing"
    )


def sums_forms() -> dict:
    """The GPU checksums' forms: one Triton launch per bucket (the default), block sums, a sum per tensor."""
    return {"kernel": protocol._gpu_sums, "blocked": protocol._blocked_sums, "per-tensor": protocol._looped_sums}


def with_sums_form(trainer: Trainer, form: str):
    """Runs a function with the checksums taken in another form on both sides."""

    def run(fn):
        trainer.control.send(("form", form))
        with mock.patch.object(protocol, "_gpu_sums", sums_forms()[form]):
            try:
                fn()
            finally:
                trainer.control.send(("form", "kernel"))

    return run


def print_rows(best: dict[str, float], nbytes: int, width: int, indent: str = "") -> None:
    """One line per timed path: its best time, GB/s and its ratio against the `copy` row (bytes/s)."""
    for name, seconds in best.items():
        print(
            f"{indent}{name:{width}s} {seconds * 1e3:8.2f} ms  {nbytes / seconds / 1e9:7.1f} GB/s"
            f"  {best['copy'] / seconds:5.2f}x of a copy"
        )


def timed(device: str, fn) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny Qwen2's shapes")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here; pass --device cpu")
    trainer = Trainer(args)
    print(f"{args.device}: {trainer.bytes / 2**20:.1f} MiB of bf16 weights in {len(trainer.buckets)} buckets")
    try:
        check(trainer)
        paths = {
            "copy": lambda: trainer.flat.copy_(trainer.flat_src),
            "checksums": lambda: [checksums(b) for b in trainer.buckets],
            "pack": trainer.pack,
            "pack-per-tensor": trainer.pack_per_tensor,
            "ipc-unverified": lambda: trainer.sync(verify=False),
            "ipc": lambda: trainer.sync(verify=True),
            "ipc-sums-read-back": lambda: trainer.sync(verify=True, pack_sums=False),
            "ipc-check-first": trainer.sync_checked_first,
        }
        if args.device != "cpu":  # the GPU's checksums in one launch per bucket, against the earlier forms
            for form in ("blocked", "per-tensor"):
                run = with_sums_form(trainer, form)
                paths[f"checksums-{form}"] = lambda run=run: run(lambda: [checksums(b) for b in trainer.buckets])
                paths[f"ipc-{form}-sums"] = lambda run=run: run(lambda: trainer.sync(verify=True, pack_sums=False))
        for fn in paths.values():  # warm-up: kernels, mappings
            fn()
        best = {name: float("inf") for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                best[name] = min(best[name], timed(args.device, fn))
    finally:
        trainer.close()
    print_rows(best, trainer.bytes, 20)
    share = {name: seconds / best["ipc-unverified"] - 1 for name, seconds in best.items()}
    print(
        f"integrity check's share of the verified sync: {share['ipc']:+.1%}",
        "(the pack's sums)" if trainer.tables else "",
    )
    others = {
        "ipc-sums-read-back": "the sums read back after the pack",
        "ipc-check-first": "the engine checking each bucket before its copies",
        "ipc-blocked-sums": "blocked sums",
        "ipc-per-tensor-sums": "per-tensor sums",
    }
    for name, form in others.items():
        if name in share:  # the last two on a GPU only
            print(f"  with {form}: {share[name]:+.1%}")


if __name__ == "__main__":
    main()
