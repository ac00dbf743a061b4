"""megatron_patches API in the pytest process (no megatron import, nothing left applied):
version check, CUDA-present no-op, the device mode (patch 3) and its thread-locality, and the
torch-only patches 4 and 5 applied and removed around each test."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import megatron_patches
from megatron_patches import (
    TESTED_MCORE_VERSIONS,
    apply_cpu_patches,
    check_mcore_version,
    cpu_device_mode,
    cuda_runtime,
    device_mode_suspended,
    installed_mcore_version,
    patches_applied,
    tensor_type_names,
)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only behaviour")


@pytest.fixture(autouse=True)
def unpatched_process():
    """These tests need a pytest process where nobody applied the patches (run megatron work
    through megarl.testing.dist.run_distributed, which applies them in the ranks)."""
    if patches_applied() or megatron_patches.mode_active_on_this_thread():
        pytest.skip("another test applied the CPU patches in the pytest process itself")


def test_installed_megatron_core_version_is_a_tested_one():
    assert installed_mcore_version() in TESTED_MCORE_VERSIONS


def test_untested_megatron_core_version_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.setattr(megatron_patches, "installed_mcore_version", lambda: "0.99.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(megatron_patches.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.99\.0 .*0\.19\.2"):
        apply_cpu_patches()
    assert not patches_applied()


def test_allow_untested_env_var_downgrades_refusal_to_warning(monkeypatch):
    monkeypatch.setenv(megatron_patches.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"0\.99\.0"):
        check_mcore_version("0.99.0")


def test_apply_does_nothing_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_patches() is False
    assert not patches_applied()
    with cpu_device_mode():  # must not move a GPU machine's tensors to CPU
        assert not torch.overrides._get_current_function_mode_stack()


@no_cuda
def test_device_mode_maps_cuda_placement_to_cpu_inside_only():
    with cpu_device_mode():
        made = [
            torch.empty(2, device="cuda"),
            torch.zeros(2, device=torch.device("cuda", 0)),
            torch.tensor([1.0], device=0),
            torch.ones(2).cuda(),
            torch.ones(2).cuda(0, non_blocking=True),
            torch.ones(2).to("cuda"),
            torch.ones(2).to(torch.device("cuda:0"), torch.float64),
            torch.ones(2).to(device="cuda:1"),
            torch.ones(2).new_zeros(3, device="cuda"),
            torch.empty_like(torch.ones(2), device="cuda"),
            torch.empty(2, pin_memory=True),
        ]
        assert all(t.device.type == "cpu" for t in made)
        assert made[6].dtype == torch.float64
        x = torch.ones(2)
        assert x.pin_memory() is x and x.cuda() is x
    assert not torch.overrides._get_current_function_mode_stack()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(2).cuda()


@no_cuda
def test_device_mode_is_thread_local():
    results = {}

    def worker():
        try:
            torch.empty(1, device="cuda")
            results["without_mode"] = "ok"
        except (RuntimeError, AssertionError):
            results["without_mode"] = "raised"
        with cpu_device_mode():
            results["with_mode"] = torch.empty(1, device="cuda").device.type

    with cpu_device_mode():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert results == {"without_mode": "raised", "with_mode": "cpu"}


@no_cuda
def test_device_mode_suspended_turns_this_threads_mode_off_for_the_block_only():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with cpu_device_mode():
        with device_mode_suspended():
            assert not torch.overrides._get_current_function_mode_stack()
            with pytest.raises((RuntimeError, AssertionError)):
                torch.empty(2, device="cuda")
        assert torch.empty(2, device="cuda").device.type == "cpu"  # back after the block
        with Watching(), device_mode_suspended():  # not the top mode: both stay
            torch.ones(2).add(1)
            assert len(torch.overrides._get_current_function_mode_stack()) == 2
        assert seen
    with device_mode_suspended():  # no mode: nothing to do
        assert not torch.overrides._get_current_function_mode_stack()


@pytest.fixture
def runtime_and_type_patches():
    cuda_runtime.apply()
    tensor_type_names.apply()
    try:
        yield
    finally:
        tensor_type_names.remove()
        cuda_runtime.remove()


@no_cuda
def test_cuda_runtime_calls_are_cpu_no_ops_while_patched(runtime_and_type_patches):
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.nvtx.range("step"):
        torch.cuda.nvtx.range_push("inner")
        torch.cuda.nvtx.range_pop()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    end.synchronize()
    assert 5.0 < start.elapsed_time(end) < 1000.0
    assert torch.cuda.get_device_capability() == (0, 0)
    assert torch.cuda.get_device_properties(0).total_memory > 0
    assert torch.cuda.is_current_stream_capturing() is False
    with cpu_device_mode():
        torch.ones(2).record_stream(stream)


@no_cuda
def test_cuda_runtime_patch_is_removed_cleanly():
    original = torch.cuda.synchronize
    cuda_runtime.apply()
    cuda_runtime.remove()
    assert torch.cuda.synchronize is original
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.Event()


@no_cuda
def test_tensor_type_reports_cuda_names_under_the_device_mode(runtime_and_type_patches):
    with cpu_device_mode():
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(2).type("torch.cuda.HalfTensor").dtype == torch.float16
        assert torch.ones(2).type(torch.float64).dtype == torch.float64
    assert torch.ones(2).type() == "torch.FloatTensor"
