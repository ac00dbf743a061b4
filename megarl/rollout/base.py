"""The rollout-engine contract: async, per request, with validated in-place weight updates.

Owns: `SamplingParams`, `Completion` and `RolloutEngine`, the base class of the vLLM backend
(`vllm_engine.py`) and the embedded `transformers` engine (`embedded.py`); re-exports
`WeightUpdateError` (defined with the weight-sync protocol, `sharding/protocol.py`).
Imports torch, the standard library and the weight-sync protocol (`sharding.plan`, `.protocol`,
`.senders`; no vLLM, Ray or megatron).

Requests are per prompt (`await engine.generate(prompt_ids, params)` → `n` completions) so
single-turn rollouts, multi-turn agent loops and asynchronous training share one API. Engines
batch concurrent requests themselves: `generate` queues the request and one background batch
at a time runs in a worker thread (`_generate_requests`).

Weights arrive through the weight-sync protocol (`sharding/protocol.py`): a `Sender` checks an
update's names and shapes against `check_update` *before* anything is loaded (a wrong name or
shape raises `WeightUpdateError` naming the tensor, and the engine keeps serving the previous
version), then streams the tensors into `load(weights, version)`, which stamps the policy version
every later completion carries. `update_weights(list of (HF name, tensor))` is the convenience
entry for tests and tools: it runs the same protocol with the engine's own sender (`sender_for`).

Log-probs (the temperature contract): a completion's log-probs are those of the distribution each
token was sampled from — log_softmax(logits / temperature), restricted to the top-k / top-p set
when those are on; temperature 1 when greedy — which is what the actor computes for
`old_log_probs` (its log-prob head divides the logits by the rollout temperature).
"""
from __future__ import annotations

import asyncio
import difflib
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

import torch

from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, HFSpec
from megarl.rollout.sharding.protocol import WeightUpdateError, bucket_tensors
from megarl.rollout.sharding.senders import sender_for

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "WeightUpdateError", "check_specs"]
WeightStream = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names and meanings)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    max_tokens: int = 64
    n: int = 1
    """Completions per prompt."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these (the stop token is kept in `token_ids`)."""
    seed: Optional[int] = None
    logprobs: bool = True
    """Return the log-prob of every sampled token under the distribution it was sampled from:
    log_softmax(logits / temperature) (greedy: temperature 1), which is what the actor computes for
    `old_log_probs` at the rollout temperature. Exact for top_p = 1 and top_k = 0. With top_p < 1
    or top_k > 0 the distribution is the truncated one (tokens outside the top-k / top-p set get
    probability 0, the rest are renormalised: vLLM's "processed_logprobs"), so a token's rollout
    log-prob is ≥ the actor's full-vocabulary one: the mismatch metrics and truncated importance
    weights then also measure the truncation, not only engine/trainer differences."""

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"n={self.n} and max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature={self.temperature} must be >= 0 and top_p={self.top_p} in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: Optional[list[float]]
    """log π(token_t | prefix) per generated token, at the sampling temperature (see `SamplingParams.logprobs`)."""
    finish_reason: str
    """"stop" (a stop token was generated) or "length" (max_tokens reached)."""
    version: int = 0
    """Policy version of the weights that generated it."""


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)


class RolloutEngine(ABC):
    """Base class: request batching, version bookkeeping and update validation."""

    in_process = True
    """The model lives in this process (weights are loaded in place); False: by IPC (`sender_for`)."""
    holds_update_tensors = False
    """`_load_weights` may keep references to streamed tensors until it returns (vLLM's layer-wise
    reload does), so producers must not reuse a tensor's memory within an update."""
    update_bucket_bytes = DEFAULT_BUCKET_BYTES
    """Bucket bound of `update_weights` (a list of tensors is bucketed like a sync)."""

    def __init__(self):
        self.version = 0
        self.asleep = False
        self._pending: list[_Request] = []
        self._flush: Optional[asyncio.Task] = None
        self._lock = threading.Lock()  # one batch or one weight update at a time

    # -- generation -------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams()
                       ) -> list[Completion]:
        """`params.n` completions of one prompt."""
        if self.asleep:
            raise RuntimeError("engine is asleep; call wake_up() before generating")
        if not prompt_token_ids:
            raise ValueError("empty prompt: at least one token id is needed")
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(map(int, prompt_token_ids)), params, future))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._run_pending())
        return await future

    async def generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()
                             ) -> list[list[Completion]]:
        """`generate` for many prompts at once (one engine batch)."""
        return list(await asyncio.gather(*(self.generate(p, params) for p in prompts)))

    def generate_sync(self, prompts, params: SamplingParams = SamplingParams()) -> list[list[Completion]]:
        """`generate_batch` from synchronous code (no running event loop)."""
        return asyncio.run(self.generate_batch(prompts, params))

    async def _run_pending(self) -> None:
        await asyncio.sleep(0)  # let concurrent callers enqueue
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                results = await asyncio.to_thread(self._locked_generate, batch)
            except BaseException as exc:  # noqa: BLE001 - every waiting request gets the error
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            for req, completions in zip(batch, results):
                if not req.future.done():
                    req.future.set_result(completions)

    def _locked_generate(self, batch: list[_Request]) -> list[list[Completion]]:
        with self._lock:
            version = self.version
            results = self._generate_requests([(r.prompt, r.params) for r in batch])
        for completions in results:
            for c in completions:
                c.version = version
        return results

    @abstractmethod
    def _generate_requests(self, requests: list[tuple[list[int], SamplingParams]]) -> list[list[Completion]]:
        """Run one batch: for every (prompt, params), `params.n` completions."""

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log π(token_t | tokens_<t) for t = 1..len-1 of every sequence (teacher forcing)."""
        with self._lock:
            return self._score(sequences)

    @abstractmethod
    def _score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        ...

    # -- memory -----------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free weights / KV cache where the engine supports it (GPU); generation refuses until wake_up."""
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    # -- weights ----------------------------------------------------------------------------
    @abstractmethod
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """HF name → shape of every tensor the engine's model loads."""

    def describe(self) -> str:
        return type(self).__name__

    def check_update(self, specs: Iterable[HFSpec | tuple], *, partial: bool = False) -> None:
        """Raise `WeightUpdateError` naming the first tensor that does not fit; loads nothing."""
        check_specs(self.expected_weights(), specs, partial=partial, engine=self.describe())

    def update_weights(self, weights: WeightStream, *, partial: bool = False, version: Optional[int] = None) -> int:
        """Load HF-named tensors (tests, tools); returns the new policy version (default: current + 1).

        The same protocol as a sync: checked first (nothing loads if any tensor does not fit), then
        bucketed (`update_bucket_bytes`) and sent by this engine's sender (`sender_for`).
        """
        weights = [(name, tensor) for name, tensor in weights]
        sender = sender_for(self)
        sender.check([HFSpec(name, tuple(t.shape), t.dtype) for name, t in weights], partial=partial)
        buckets = bucket_tensors(weights, self.update_bucket_bytes, shared=sender.shares_buffers)
        return sender.send(buckets, self.version + 1 if version is None else version)

    def load(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy already-checked tensors in place and take policy `version` (an in-place sender calls this)."""
        with self._lock:
            self._load_weights(weights)
            self.version = version
        return version

    @abstractmethod
    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy the tensors into the model in place and drop caches derived from old weights."""


def check_specs(expected: dict[str, tuple[int, ...]], specs: Iterable[HFSpec | tuple], *, partial: bool = False,
                engine: str = "engine") -> None:
    """Names and shapes of an update against the model's; the error names the tensor and the fix."""
    seen = set()
    for spec in specs:
        name, shape = (spec.name, spec.shape) if isinstance(spec, HFSpec) else (spec[0], tuple(spec[1]))
        if name not in expected:
            close = difflib.get_close_matches(name, list(expected), n=3)
            raise WeightUpdateError(
                f"weight update has tensor {name!r}, which the {engine} model does not have"
                f"{f' (closest: {close})' if close else ''}; nothing was loaded, the engine keeps serving"
                " the previous version. Are the trainer and the engine built from the same architecture?")
        if tuple(shape) != tuple(expected[name]):
            raise WeightUpdateError(
                f"weight update has tensor {name!r} with shape {tuple(shape)}, but the {engine} model expects"
                f" {tuple(expected[name])}; nothing was loaded, the engine keeps serving the previous version."
                " Do the trainer's and the engine's config.json match?")
        if name in seen:
            raise WeightUpdateError(f"weight update has tensor {name!r} twice; nothing was loaded")
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing and not partial:
        raise WeightUpdateError(
            f"weight update lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}; nothing was loaded"
            " (pass partial=True to update a subset)")


def run_sync(coro):
    """Run a coroutine from synchronous code (a fresh event loop)."""
    return asyncio.run(coro)
