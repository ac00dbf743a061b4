"""The vLLM rollout backend, in-process (`vllm.LLM`), with weights pushed in place.

Owns: `VLLMEngine`. By default the engine runs in the calling process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so an engine server (`server.py`) or a single-process
trainer streams it (HF name, tensor) views of each bucket (`sharding.senders.InPlaceSender`):
`llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=...))` feeds them to the
model's own weight loaders (vLLM shards them for its TP), the re-pack fixes of
`megarl.rollout.vllm_patches` run, then the prefix cache is reset (cached KV belongs to the old
weights). vLLM's layer-wise reload keeps a layer's tensors until the layer is complete (padded
layers until the end), so producers give it a fresh buffer per bucket (`holds_update_tensors`).
Updates are checked first against the HF checkpoint the engine was built from (safetensors
headers: names and shapes), so a bad update loads nothing.

Log-probs: `logprobs_mode="processed_logprobs"`, so a sampled token's log-prob is taken from the
distribution it was sampled from (logits / temperature, then top-k / top-p; vLLM 0.32
`Sampler.sample` and `TopKTopPSampler`); greedy requests get log_softmax(logits). Prompt log-probs
(`score`) are unaffected (vLLM computes them from the raw logits in every mode). On CUDA this mode
keeps vLLM on its PyTorch-native top-k/top-p sampler (FlashInfer's does not return processed
log-probs; vLLM picks the native one itself).

Sleep/wake: on GPU `llm.sleep(level=1)` offloads weights and drops the KV cache around training
(needs `enable_sleep_mode=True`, set by default with CUDA); on CPU there is nothing to offload and
both are no-ops apart from refusing requests while asleep. In a process that is already a
torch.distributed rank (colocated with training) the engine core runs in a child process
instead — vLLM's in-process start-up would run collectives on the training world and hang —
and updates travel as IPC buckets (`sharding/ipc.py`: `IpcSender`, and `MegarlWorkerExtension`,
installed as vLLM's `worker_extension_cls` on every engine): shared memory on CPU, CUDA IPC on GPU.

Stop behaviour: `ignore_eos=True`, generation stops only at `SamplingParams.stop_token_ids` (put
the EOS id there), so both backends and `transformers` agree on what ends a completion.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams
from megarl.rollout.vllm_patches import repack_after_reload

WORKER_EXTENSION = "megarl.rollout.sharding.ipc.MegarlWorkerExtension"


class VLLMEngine(RolloutEngine):
    """`vllm.LLM` behind the rollout-engine API (CPU build in tests, CUDA in production).

    in_process: True runs vLLM's engine core in this process (weights stream in as a Python
    iterator); False runs it in a child process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`) and updates
    travel as IPC buckets (`update_weights` makes buckets of `update_bucket_bytes`). None picks
    in-process unless this process is already in a torch.distributed world (a colocated training
    rank): vLLM's in-process start-up would then create groups on the training world
    (`new_group`), a collective the other training ranks never join, and hang. visible_devices: CUDA_VISIBLE_DEVICES of the processes vLLM starts
    when not in process (a colocated GPU engine: the training rank's own GPUs). TP > 1 uses vLLM's
    multiprocessing executor (never its Ray executor, which would ask for GPUs our pools hold).
    """

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", max_model_len: Optional[int] = None,
                 seed: int = 0, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 enforce_eager: Optional[bool] = None, cpu_kv_cache_bytes: int = 256 << 20,
                 in_process: Optional[bool] = None, update_bucket_bytes: Optional[int] = None,
                 visible_devices: Optional[str] = None, **llm_kwargs):
        super().__init__()
        import torch.distributed as dist

        self.in_process = (not (dist.is_available() and dist.is_initialized())) if in_process is None \
            else in_process
        if update_bucket_bytes is not None:
            self.update_bucket_bytes = update_bucket_bytes
        _set_vllm_multiprocessing(not self.in_process)
        from vllm import LLM

        self.model_path = str(model_path)
        self.on_gpu = torch.cuda.is_available()
        kwargs = dict(model=self.model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                      skip_tokenizer_init=True, tensor_parallel_size=tensor_parallel_size,
                      enforce_eager=(not self.on_gpu) if enforce_eager is None else enforce_eager,
                      worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs")
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:  # on CPU gpu_memory_utilization would reserve a share of host RAM; size the KV cache instead
            kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes)
        if tensor_parallel_size > 1:  # vLLM's own worker processes; never Ray's executor inside our placement groups
            kwargs["distributed_executor_backend"] = "mp"
        kwargs.update(llm_kwargs)
        with _child_visible_devices(None if self.in_process else visible_devices):
            self.llm = LLM(**kwargs)
        self._expected = checkpoint_shapes(self.model_path)
        atexit.register(self.shutdown)

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process (multiprocess mode), so it does not outlive this process."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def describe(self) -> str:
        return f"vLLM ({Path(self.model_path).name})"

    # -- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self._expected

    holds_update_tensors = True  # vLLM's layer-wise reload buffers a layer's tensors until it is complete

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        if not self.in_process:
            raise RuntimeError("this vLLM engine's core runs in a child process: updates reach it by IPC"
                               " (megarl.rollout.sharding.senders.sender_for(engine) gives an IpcSender)")
        names: list[str] = []
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=_tap_names(weights, names)))
        self.llm.collective_rpc(repack_after_reload, args=(names,))
        self.llm.reset_prefix_cache()

    def load_by_ipc(self, address_template: str, authkey: bytes, version: int) -> int:
        """Load an update whose buckets arrive by IPC handle (`sharding.ipc.IpcSender` drives this)."""
        with self._lock:
            self.llm.collective_rpc("megarl_reload_by_ipc", args=(address_template, authkey))
            self.llm.reset_prefix_cache()
            self.version = version
        return version

    def sleep(self) -> None:
        if self.on_gpu:
            self.llm.sleep(level=1)
        super().sleep()

    def wake_up(self) -> None:
        if self.on_gpu:
            self.llm.wake_up()
        super().wake_up()

    # -- generation -------------------------------------------------------------------------
    def _generate_requests(self, requests):
        # vLLM refuses n > 1 with greedy sampling: send n copies of such a request instead
        copies = [params.n if params.greedy else 1 for _, params in requests]
        prompts = [{"prompt_token_ids": prompt} for (prompt, _), k in zip(requests, copies) for _ in range(k)]
        vparams = [_vllm_params(params, n=1 if k > 1 else params.n) for (_, params), k in zip(requests, copies)
                   for _ in range(k)]
        outputs = iter(self.llm.generate(prompts, vparams, use_tqdm=False))
        results = []
        for (_, params), k in zip(requests, copies):
            results.append([_completion(o, params.logprobs) for _ in range(k) for o in next(outputs).outputs])
        return results

    def _score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        from vllm import SamplingParams as VSamplingParams

        params = VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(map(int, s))} for s in sequences], params,
                                    use_tqdm=False)
        return [[pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]


def _vllm_params(params: SamplingParams, n: int):
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(
        n=n, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
        max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids), seed=params.seed,
        logprobs=0 if params.logprobs else None, ignore_eos=True, detokenize=False,
    )


def _completion(output, with_logprobs: bool) -> Completion:
    tokens = list(output.token_ids)
    logprobs = [step[tok].logprob for step, tok in zip(output.logprobs, tokens)] if with_logprobs else None
    return Completion(tokens, logprobs, output.finish_reason or "length")


@contextlib.contextmanager
def _child_visible_devices(devices: Optional[str]):
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


def _set_vllm_multiprocessing(enabled: bool) -> None:
    """Choose vLLM's engine-core placement before it starts (vLLM caches env reads after an engine start)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if enabled else "0"
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def _tap_names(weights, names: list):
    for name, tensor in weights:
        names.append(name)
        yield name, tensor


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every tensor in a safetensors checkpoint, from the headers (nothing loaded)."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    shapes = {}
    for filename in files:
        with safe_open(str(path / filename), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
