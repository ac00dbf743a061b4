"""`copysum`: the one-pass copy+checksum a vLLM CPU worker replays weight updates with."""

import pytest
import torch

from megarl.rollout.sharding import copysum


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The helper built anew, into an empty cache (nothing built earlier is reused)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    copysum._library.cache_clear()
    yield tmp_path
    copysum._library.cache_clear()


def test_it_copies_the_bytes_and_returns_the_sum_torch_gives(fresh_build):
    """Into destinations of every alignment a float32 slice can have, lengths around its 4-word loop, sums
    that wrap; built from source by the host's compiler into megarl's cache."""
    assert copysum.available()
    assert list((fresh_build / "megarl").glob("copysum-*.so"))
    generator = torch.Generator().manual_seed(0)
    for numel in (0, 1, 3, 4, 5, 7, 1000, 12_345):
        words = torch.randint(-(2**62), 2**62, (numel,), dtype=torch.int64, generator=generator)
        for lead in range(4):
            dst = torch.zeros(2 * numel + 4)[lead : lead + 2 * numel]  # 4-byte steps off a 16-byte boundary
            assert copysum.copy_sum(dst, words) == int(words.sum()), (numel, lead)
            assert torch.equal(dst.view(torch.int64) if lead % 2 == 0 else dst.clone().view(torch.int64), words)


def test_without_a_compiler_or_when_turned_off_it_is_not_available(fresh_build, monkeypatch):
    monkeypatch.setenv("PATH", str(fresh_build))  # no cc, no gcc
    monkeypatch.delenv("CC", raising=False)
    assert not copysum.available()
    with pytest.raises(RuntimeError, match="native helper"):
        copysum.copy_sum(torch.empty(2), torch.zeros(1, dtype=torch.int64))
    copysum._library.cache_clear()
    monkeypatch.setenv("MEGARL_NATIVE_COPY_SUM", "0")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert not copysum.available()


def test_sizes_that_differ_are_refused(fresh_build):
    with pytest.raises(ValueError, match="16 bytes into, 8 from"):
        copysum.copy_sum(torch.empty(4), torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("native", [True, False])
def test_copy_into_equals_torch_copy_for_every_kind_of_pair(fresh_build, monkeypatch, native):
    """`copy_into` (an engine's unchecked load) gives what `copy_` gives: by the native copy where the pair is
    byte for byte (contiguous, one dtype and shape, whole aligned words), torch's copy for the rest
    (a transposed source, another dtype, an odd byte count, a source off an 8-byte boundary, no helper)."""
    if not native:
        monkeypatch.setenv("MEGARL_NATIVE_COPY_SUM", "0")
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=generator)
    sources = [
        base[:4096].view(64, 64),  # native where available
        base[:4096].view(64, 64).t(),  # not contiguous
        base[1:4097].view(64, 64),  # 4 bytes off an 8-byte boundary
        base[:7],  # 28 bytes: not whole words
        base[:4096].to(torch.bfloat16),
    ]
    for src in sources:
        for dtype in (src.dtype, torch.float64):
            dst, want = torch.zeros(src.shape, dtype=dtype), torch.zeros(src.shape, dtype=dtype)
            copysum.copy_into(dst, src)
            assert torch.equal(dst, want.copy_(src)), (src.shape, src.dtype, dtype)
    calls = []
    monkeypatch.setattr(copysum, "copy_sum", lambda *args: calls.append(args))
    copysum.copy_into(torch.empty(64, 64), sources[0])
    assert len(calls) == (1 if native else 0)  # the byte-for-byte pair went the native way
