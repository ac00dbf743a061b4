"""`ReplayingLoader`: an update's copies recorded from the model's own loader, validated on the next
update, then replayed — and given up where the loader does more than copy."""

import pytest
import torch

from megarl.rollout.load_plan import ReplayingLoader


class Toy(torch.nn.Module):
    """A fused qkv (q, k, v land in row blocks, like vLLM's QKVParallelLinear) and an embedding padded to
    8 rows whose padding the loader zeroes (like VocabParallelEmbedding)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((8, 4), 7.0), requires_grad=False)

    def load_weights(self, weights):
        rows = {"q": (0, 2), "k": (2, 2), "v": (4, 2)}
        for name, tensor in weights:
            if name == "embed":
                self.embed.data[: tensor.shape[0]].copy_(tensor)
                self.embed.data[tensor.shape[0] :].fill_(0)
            else:
                start, size = rows[name]
                self.qkv.data.narrow(0, start, size).copy_(tensor.narrow(1, 0, 4))  # a slice of the tensor


def update(seed: int, names=("q", "k", "v", "embed")) -> list[tuple[str, torch.Tensor]]:
    """The update's tensors as views of one flat buffer (a bucket); q/k/v wider than the parameter."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (2, 6), "k": (2, 6), "v": (2, 6), "embed": (5, 4)}
    buffer = torch.randn(sum(torch.Size(shapes[n]).numel() for n in names), generator=g)
    out, offset = [], 0
    for name in names:
        numel = torch.Size(shapes[name]).numel()
        out.append((name, buffer[offset : offset + numel].view(shapes[name])))
        offset += numel
    return out


def loaded(weights) -> dict:
    model = Toy()
    model.load_weights(weights)
    return {n: p.clone() for n, p in model.named_parameters()}


def same(model, expected) -> bool:
    return all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def test_the_third_update_on_is_replayed_and_equals_the_loader():
    model, calls = Toy(), []
    loader = ReplayingLoader(model.named_parameters)

    def real(weights):
        calls.append(1)
        model.load_weights(weights)

    for seed in range(5):
        weights = update(seed)
        loader.load(real, iter(weights))
        assert same(model, loaded(weights))
    assert len(calls) == 2  # recorded; validated (replayed, then loaded again to compare); then replays only
    assert loader.replayed == 3 * 4 and not loader.disabled


def test_other_tensors_stop_the_replay_and_are_recorded_afresh():
    model = Toy()
    loader = ReplayingLoader(model.named_parameters)
    for seed in range(3):
        loader.load(model.load_weights, iter(update(seed)))
    partial = update(10, names=("q", "embed"))  # k and v left out: replayed up to embed, then the real loader
    loader.load(model.load_weights, iter(partial))
    expected = loaded(update(2))
    expected.update({n: p for n, p in loaded(partial).items() if n == "embed"})
    expected["qkv"][0:2] = partial[0][1][:, :4]
    assert same(model, expected)
    for seed in (20, 21, 22):  # re-recorded, validated, replayed
        loader.load(model.load_weights, iter(update(seed)))
        assert same(model, loaded(update(seed)))
    assert loader.replayed == 4 + 4 and not loader.disabled  # the partial update was loaded for real


def test_a_loader_that_does_more_than_copy_is_never_replayed():
    class Scaled(Toy):  # copies, then scales: the recording sees only the copy; validation catches it
        def load_weights(self, weights):
            super().load_weights(weights)
            self.qkv.data.mul_(2)

    class Computed(Toy):  # copies a computed tensor: nothing to record
        def load_weights(self, weights):
            super().load_weights((n, t * 1) for n, t in weights)

    class Clamped(Toy):  # an in-place op after the copy that the validation's data may not reveal
        def load_weights(self, weights):
            super().load_weights(weights)
            self.qkv.data.clamp_(max=10.0)

    class Indexed(Toy):  # writes by indexed assignment, no copy_
        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "embed":
                    self.embed.data[: tensor.shape[0]] = tensor

    class Flipped(Toy):  # copies, then moves rows around behind torch's back: the same bytes, in other places
        def load_weights(self, weights):
            super().load_weights(weights)
            rows = self.qkv.data.numpy()
            rows[:] = rows[::-1].copy()

    for cls in (Scaled, Computed, Clamped, Indexed, Flipped):
        model, reference = cls(), cls()
        loader = ReplayingLoader(model.named_parameters)
        for seed in range(4):
            weights = update(seed)
            loader.load(model.load_weights, iter(weights))
            reference.load_weights(iter(weights))
            assert same(model, dict(reference.named_parameters())), cls.__name__
        assert loader.disabled and loader.replayed == 0


def test_a_parameter_given_new_memory_ends_the_replay():
    model = Toy()
    loader = ReplayingLoader(model.named_parameters)
    for seed in range(3):
        loader.load(model.load_weights, iter(update(seed)))
    model.qkv.data = torch.zeros(6, 4)  # the recorded views now point at memory the model no longer uses
    loader.load(model.load_weights, iter(update(3)))
    assert same(model, loaded(update(3))) and loader.disabled


@pytest.fixture(params=["one pass", "no compiler"])
def native(request, monkeypatch):
    """The one-pass copy+checksum built here, or missing (no C compiler: checked with torch.sum, then copied)."""
    from megarl.rollout.sharding import copysum

    if request.param == "no compiler":
        monkeypatch.setenv("MEGARL_NATIVE_COPY_SUM", "0")
    copysum._library.cache_clear()
    yield copysum.available()
    copysum._library.cache_clear()


def checked_bucket(weights):
    """The update as a received bucket: flat, with the sender's checksums still to be checked."""
    from megarl.rollout.sharding.protocol import bucket_tensors, checksums, verify_bucket

    (bucket,) = bucket_tensors(weights, 10**6)
    return verify_bucket(bucket, checksums(bucket))


def test_a_replay_checks_each_tensor_as_it_copies_it_and_stops_at_a_corrupted_one(native, monkeypatch):
    """From the third update on, a tensor the loader copies whole into a parameter (`embed`) is copied and
    summed in one pass (`copysum`, where it is built); one it takes a slice of (q/k/v) is checked first. A
    tensor whose bytes changed after the sender's sums fails the update naming it: `embed` as it is copied
    in one pass (before it, without the helper), `k` before it is copied (and v not loaded either)."""
    from megarl.rollout import WeightUpdateError
    from megarl.rollout.sharding import copysum

    model = Toy()
    loader = ReplayingLoader(model.named_parameters)
    fused = []
    real_copy_sum = copysum.copy_sum
    monkeypatch.setattr(copysum, "copy_sum", lambda dst, words: fused.append(dst.shape) or real_copy_sum(dst, words))
    for seed in range(3):
        bucket = checked_bucket(update(seed))
        loader.load_checked(model.load_weights, bucket.pending())
        assert same(model, loaded(update(seed)))
    assert loader.replayed == 4 and fused == ([torch.Size([5, 4])] if native else [])

    bucket = checked_bucket(update(3))
    bucket.pending()[3][1][-1, -1] += 1.0
    found = "found as it was copied into the model" if native else "neither it nor any tensor after it"
    with pytest.raises(WeightUpdateError, match=rf"'embed'.*checksum mismatch.*{found}"):
        loader.load_checked(model.load_weights, bucket.pending())
    assert torch.equal(model.qkv, loaded(update(3))["qkv"])

    # a failed update drops the plan: the next one goes through the real loader, each tensor checked first
    before = {n: p.clone() for n, p in model.named_parameters()}
    bucket = checked_bucket(update(4))
    bucket.pending()[1][1][1, 2] += 1.0  # inside the slice the loader takes
    with pytest.raises(WeightUpdateError, match=r"'k'.*checksum mismatch.*neither it nor any tensor after it"):
        loader.load_checked(model.load_weights, bucket.pending())
    assert torch.equal(model.qkv[2:], before["qkv"][2:]) and torch.equal(model.embed, before["embed"])
    assert torch.equal(model.qkv[:2], update(4)[0][1][:, :4])  # q, before it, was loaded


class Fused(torch.nn.Module):
    """Every parameter filled by whole update tensors: q, k, v into the row blocks of a fused qkv, an embedding
    alone (what vLLM's CPU linears get at rollout TP 1)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(5, 4), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "embed":
                self.embed.data.copy_(tensor)
            else:
                self.qkv.data.narrow(0, {"q": 0, "k": 2, "v": 4}[name], 2).copy_(tensor)


def kept_update(buffer: torch.Tensor, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New values written into the one buffer the sender keeps (as its ranks do every sync); views of it."""
    buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(seed)))
    shapes = {"q": (2, 4), "k": (2, 4), "v": (2, 4), "embed": (5, 4)}
    out, offset = [], 0
    for name, shape in shapes.items():
        out.append((name, buffer[offset : offset + shape[0] * shape[1]].view(shape)))
        offset += shape[0] * shape[1]
    return out


def within(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel() * buffer.element_size()


def test_parameters_adopt_the_kept_buffer_then_updates_are_in_place_and_other_loads_release_them():
    from megarl.rollout.sharding.plan import HFSlot
    from megarl.rollout.sharding.protocol import (
        FlatBucket,
        WeightUpdateError,
        check_in_place,
        checksums,
        verify_bucket,
    )

    model, buffer = Fused(), torch.empty(44)
    loader = ReplayingLoader(model.named_parameters)
    assert loader.adopt() == 0  # nothing replayed yet
    for seed in range(3):  # recorded, validated, replayed
        weights = kept_update(buffer, seed)
        loader.load(model.load_weights, iter(weights))
        assert same(model, _fused(weights))
    assert loader.adopt() == 44 * 4 and loader.adopted == {"qkv", "embed"}
    assert all(within(p, buffer) for p in model.parameters())
    weights = kept_update(buffer, 7)  # the trainer's ranks write the next update: it is the model's already
    assert same(model, _fused(weights))
    entries, offset = [], 0
    for name, tensor in weights:
        entries.append(HFSlot(name, tuple(tensor.shape), offset))
        offset += tensor.numel()
    bucket = FlatBucket(buffer, tuple(entries))
    sums = checksums(bucket)
    loader.load_checked(model.load_weights, verify_bucket(bucket, sums).pending())  # replayed: only checked
    assert loader.adopted == {"qkv", "embed"} and loader.replayed == 2 * 4 and same(model, _fused(weights))
    buffer[9] += 1.0  # k's bytes change after the sender summed them
    with pytest.raises(WeightUpdateError, match="'k'.*found as it was copied into the model"):
        loader.load_checked(model.load_weights, verify_bucket(bucket, sums).pending())
    # the IPC worker's form: the in-place checks wait for the bucket's end, then one sum takes them all
    later, received = [], verify_bucket(bucket, sums)
    for seed in range(3):  # the failed update dropped the plan: recorded, validated, replayed and adopted again
        loader.load(model.load_weights, iter(kept_update(buffer, seed)))
    assert loader.adopt() == 44 * 4
    kept_update(buffer, 7)  # the bytes `sums` were taken of
    buffer[9] += 1.0
    loader.load_checked(model.load_weights, received.pending(later))
    assert later == [0, 1, 2, 3]
    with pytest.raises(WeightUpdateError, match=r"'k' differ.*found as it was copied into the model"):
        check_in_place(received, later)
    with pytest.raises(WeightUpdateError, match="'k'"):
        check_in_place(received, [1, 3])
    check_in_place(received, [0, 2, 3])  # q, v and embed are as summed
    buffer[-1] += 1.0  # embed's too: the message names k and counts the other one
    with pytest.raises(WeightUpdateError, match=r"'k' \(and 1 more tensor\(s\) of its bucket\) differ"):
        check_in_place(received, later)
    with pytest.raises(WeightUpdateError, match=r"'embed' differ"):
        check_in_place(received, [0, 2, 3])
    other = kept_update(torch.empty(44), 3)  # other tensors, from elsewhere: the real loader, after a release
    other = [other[0], other[3]]
    loader.load(model.load_weights, iter(other))
    assert not loader.adopted and not any(within(p, buffer) for p in model.parameters())
    assert torch.equal(model.qkv[:2], other[0][1]) and torch.equal(model.embed, other[1][1])
    before = {n: p.clone() for n, p in model.named_parameters()}
    buffer.fill_(3.0)  # the sender's buffer is no longer the model
    assert same(model, before)


def _fused(weights) -> dict:
    model = Fused()
    model.load_weights(weights)
    return {n: p.clone() for n, p in model.named_parameters()}


def test_an_adopted_tensor_arriving_elsewhere_releases_the_parameters_and_the_replay_goes_on():
    """The same tensors in another layout of the same buffer (another sender's bucketing): replaying q into the
    adopted qkv would overwrite the bytes embed still has to be read from. The parameters get memory of their
    own first, the plan's copies follow them, and the next update from the kept layout is adopted again."""
    model, buffer = Fused(), torch.empty(44)
    loader = ReplayingLoader(model.named_parameters)
    for seed in range(3):
        loader.load(model.load_weights, iter(kept_update(buffer, seed)))
    assert loader.adopt() == 44 * 4
    buffer.copy_(torch.randn(44, generator=torch.Generator().manual_seed(9)))
    shifted = [  # embed first in the buffer now, then q, k, v: the update still lists q, k, v, embed
        ("q", buffer[20:28].view(2, 4)),
        ("k", buffer[28:36].view(2, 4)),
        ("v", buffer[36:44].view(2, 4)),
        ("embed", buffer[0:20].view(5, 4)),
    ]
    expected = _fused([(n, t.clone()) for n, t in shifted])
    loader.load(model.load_weights, iter(shifted))
    assert same(model, expected) and not loader.adopted and loader.replayed == 2 * 4
    assert not any(within(p, buffer) for p in model.parameters())
    weights = kept_update(buffer, 10)  # the kept layout again: replayed by copies, then adopted again
    loader.load(model.load_weights, iter(weights))
    assert same(model, _fused(weights)) and loader.adopt() == 44 * 4
    assert same(model, _fused(kept_update(buffer, 11)))
