"""The rollout-engine contract: async, per request, continuously batched, with validated weight updates.

Owns: `SamplingParams`, `Completion` and `RolloutEngine`, the base class of the vLLM backend
(`vllm_engine.py`: vLLM's `AsyncLLM`) and the embedded `transformers` engine (`embedded.py`);
re-exports `WeightUpdateError` (defined with the weight-sync protocol, `sharding/protocol.py`).
Imports torch, the standard library, the engine loop (`loop.py`) and the weight-sync protocol
(`sharding.plan`, `.protocol`, `.senders`; no vLLM, Ray or megatron).

Requests are per prompt, with an id and an optional session id (the turns of one conversation):

    completions = await engine.generate(prompt_ids, params, request_id="r1", session_id="s1")
    await engine.abort(["r1"])          # r1's generate returns its partial output, finish_reason "abort"
    engine.generate_sync(prompts, params)   # a batch from plain code (one list of completions per prompt)

Every engine runs its coroutines on an event loop of its own (`loop.EngineLoop`), so `generate` may
be awaited from any thread and any event loop at once; a request joins the batch that is running
(vLLM: continuous batching; the embedded engine: at its next batch). The session id is for routing
and logs only (the driver sends every turn of a session to one engine, whose prefix cache then
holds the conversation).

Weight updates: a `Sender` checks an update's names and shapes against `check_update` *before*
anything is loaded (a wrong name or shape raises `WeightUpdateError` naming the tensor and the
engine keeps serving the previous version), then streams the tensors in. Loading runs inside
`updating(version)`: the engine pauses (`update_mode`: "keep" freezes in-flight requests, which
continue on the new weights after it — partial rollouts, their KV recomputed on the new weights;
"abort" ends them with their partial outputs; "wait" drains them first), loads, takes the policy
`version`, and resumes. Every generated token carries the version of the weights that produced it
(`Completion.versions`): tokens before an update the old one, after it the new one. A failure before
any tensor reached the model resumes on the previous weights and version; a failure after that
leaves weights of two versions in the model, so the engine ends its in-flight requests (partial
outputs, finish_reason "abort": nothing is lost) and refuses new ones until an update succeeds.
`update_weights(list of (HF name, tensor))` is the convenience entry for tests and tools: it runs
the same protocol with the engine's own sender (`sender_for`). A caller may also `pause(mode)` and
`resume()` around an update itself (engine servers do, so all engines switch together). A backend may
pause an engine with nothing in flight by holding new requests in megarl (`hold_requests`; `abort`
ends a held one at once, without tokens) instead of a round trip to its engine.

Log-probs (the temperature contract): a completion's log-probs are those of the distribution each
token was sampled from — log_softmax(logits / temperature), restricted to the top-k / top-p set
when those are on; temperature 1 when greedy — which is what the actor computes for
`old_log_probs` (its log-prob head divides the logits by the rollout temperature).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

import torch

from megarl.rollout.loop import EngineLoop
from megarl.rollout.sharding.plan import DEFAULT_BUCKET_BYTES, HFSpec
from megarl.rollout.sharding.protocol import UpdateProgress, WeightUpdateError, bucket_tensors
from megarl.rollout.sharding.senders import sender_for

__all__ = ["Completion", "PAUSE_MODES", "RolloutEngine", "SamplingParams", "WeightUpdateError", "check_specs"]
WeightStream = Iterable[tuple[str, torch.Tensor]]
PAUSE_MODES = ("keep", "abort", "wait")
"""How a pause treats in-flight requests: keep (freeze; they continue after `resume`, on the weights
loaded meanwhile), abort (end now with their partial outputs, finish_reason "abort"), wait (drain first)."""


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
    """"stop" (a stop token was generated), "length" (max_tokens reached) or "abort" (`abort`, or a
    pause in mode abort, ended it: the tokens are what was generated until then)."""
    version: int = 0
    """The oldest policy version among its tokens (the engine's version when it has none): the
    version a staleness bound compares with."""
    versions: list[int] = field(default_factory=list)
    """Policy version of the weights that generated each token (one per token): a request that ran
    across a weight update carries the old version up to the switch and the new one after it."""
    request_id: str = ""
    """The id of the request that produced it (the caller's, or one the engine made up)."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the engine's prefix cache (vLLM; 0 for the embedded engine)."""


def make_completion(
    token_ids, logprobs, finish_reason: str, versions: Sequence[int], current: int, num_cached_tokens: int = 0
) -> Completion:
    """A `Completion` whose `version` follows from its per-token `versions` (`current` when it has no token)."""
    versions = [int(v) for v in versions]
    return Completion(
        list(token_ids),
        logprobs,
        finish_reason,
        version=min(versions, default=current),
        versions=versions,
        num_cached_tokens=num_cached_tokens,
    )


class RolloutEngine(ABC):
    """Base class: the engine loop, request ids, pause/resume, version bookkeeping and update validation.

    Backends implement the coroutines `_generate`, `_abort`, `_pause`, `_resume` (run on the engine
    loop), and `_score`, `_load_weights` / an IPC load, `expected_weights`.
    update_mode: how in-flight requests ride through a weight update (`PAUSE_MODES`).
    """

    in_process = True
    """The model lives in this process (weights are loaded in place); False: by IPC (`sender_for`)."""
    holds_update_tensors = False
    """`_load_weights` may keep references to streamed tensors until it returns (vLLM's layer-wise
    reload does), so producers must not reuse a tensor's memory within an update."""
    update_bucket_bytes = DEFAULT_BUCKET_BYTES
    """Bucket bound of `update_weights` (a list of tensors is bucketed like a sync)."""

    def __init__(self, *, update_mode: str = "keep"):
        _check_mode(update_mode, "update_mode")
        self.update_mode = update_mode
        self.version = 0
        self.asleep = False
        self.paused = False
        self.broken: Optional[str] = None
        """Why the engine refuses requests after an update failed partway (None: it serves)."""
        self.loop = EngineLoop(f"megarl-{type(self).__name__}")
        self._requests: dict[str, Optional[str]] = {}  # in flight: request id → session id (engine loop only)
        self._held: Optional[asyncio.Event] = None  # set while new requests wait here (`hold_requests`)
        self._waiting: dict[str, bool] = {}  # held request id → aborted meanwhile
        self._update_lock = threading.Lock()  # one weight update at a time

    # -- generation -------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        *,
        request_id: Optional[str] = None,
        session_id: Optional[str] = None,
    ) -> list[Completion]:
        """`params.n` completions of one prompt; joins the running batch. Awaitable from any event loop."""
        if not prompt_token_ids:
            raise ValueError("empty prompt: at least one token id is needed")
        prompt = list(map(int, prompt_token_ids))
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        return await self.loop.call(self._serve(prompt, params, str(request_id), session_id))

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()
    ) -> list[list[Completion]]:
        """`generate` for many prompts at once."""
        return list(await asyncio.gather(*(self.generate(p, params) for p in prompts)))

    def generate_sync(self, prompts, params: SamplingParams = SamplingParams()) -> list[list[Completion]]:
        """`generate_batch` from plain code (blocks this thread, never the engine's loop)."""
        return self.loop.run(self.generate_batch(prompts, params))

    def run_sync(self, coro):
        """Run one of the engine's coroutines (`abort`, `pause`, ...) from plain code."""
        return self.loop.run(coro)

    @property
    def num_requests(self) -> int:
        """Requests in flight (queued or running)."""
        return len(self._requests)

    async def _serve(self, prompt: list[int], params: SamplingParams, request_id: str, session_id) -> list[Completion]:
        if request_id in self._requests:
            raise ValueError(
                f"request id {request_id!r} is already in flight on this engine; request ids must be"
                " unique (leave request_id=None for a fresh one)"
            )
        self._requests[request_id] = session_id
        try:
            if self._held is not None and not await self._wait_held(request_id):  # aborted while held
                logprobs = [] if params.logprobs else None
                completions = [make_completion([], logprobs, "abort", [], self.version) for _ in range(params.n)]
            else:
                if self.asleep:
                    raise RuntimeError("engine is asleep; call wake_up() before generating")
                if self.broken:
                    raise RuntimeError(self.broken)
                completions = await self._generate(prompt, params, request_id)
        finally:
            self._requests.pop(request_id, None)
        for c in completions:
            c.request_id = request_id
        return completions

    async def _wait_held(self, request_id: str) -> bool:
        """Wait while `hold_requests` holds new requests; False when `abort` ended this one meanwhile."""
        self._waiting[request_id] = False
        try:
            while self._held is not None and not self._waiting[request_id]:
                await self._held.wait()
            return not self._waiting[request_id]
        finally:
            del self._waiting[request_id]

    @abstractmethod
    async def _generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> list[Completion]:
        """On the engine loop: `params.n` completions of one request (partial, finish "abort", when aborted)."""

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """End these requests now; their `generate` calls return the partial outputs (unknown ids: ignored)."""
        ids = [request_ids] if isinstance(request_ids, str) else [str(i) for i in request_ids]
        await self.loop.call(self._abort_known(ids))

    async def _abort_known(self, ids: list[str]) -> None:
        held = [i for i in ids if i in self._waiting]
        for i in held:  # still held (`hold_requests`): they end now, without reaching the backend
            self._waiting[i] = True
        if held and self._held is not None:  # wake every waiter; the others wait on a new event
            self._held, wake = asyncio.Event(), self._held
            wake.set()
        known = [i for i in ids if i in self._requests and i not in self._waiting]
        if known:
            await self._abort(known)

    @abstractmethod
    async def _abort(self, request_ids: list[str]) -> None:
        """On the engine loop: end these in-flight requests with their partial outputs."""

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log π(token_t | tokens_<t) for t = 1..len-1 of every sequence (teacher forcing)."""
        return self._score(sequences)

    @abstractmethod
    def _score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]: ...

    # -- pause / resume ---------------------------------------------------------------------
    async def pause(self, mode: str = "keep") -> None:
        """Stop generating (`PAUSE_MODES`); new requests queue until `resume`. A no-op when paused."""
        _check_mode(mode, "pause mode")
        await self.loop.call(self._pause_once(mode))

    async def _pause_once(self, mode: str) -> None:
        if self.paused:
            return
        self.paused = True
        try:
            await self._pause(mode)
        except BaseException:
            self.paused = False
            await self._resume()
            raise

    async def resume(self) -> None:
        """Continue generating: kept and queued requests run (on the weights loaded meanwhile)."""
        await self.loop.call(self._resume_once())

    async def _resume_once(self) -> None:
        if self.paused:
            await self._resume()
            self.paused = False

    def hold_requests(self) -> None:
        """On the engine loop: new requests wait in `_serve` until `release_requests` (a pause of an engine
        with nothing in flight needs no more; none of them reaches the backend meanwhile)."""
        if self._held is None:
            self._held = asyncio.Event()

    def release_requests(self) -> None:
        """On the engine loop: the requests `hold_requests` kept waiting go on."""
        held, self._held = self._held, None
        if held is not None:
            held.set()

    @abstractmethod
    async def _pause(self, mode: str) -> None:
        """On the engine loop: returns once no forward pass runs (keep, abort) or in-flight requests are done (wait)."""

    @abstractmethod
    async def _resume(self) -> None: ...

    # -- memory -----------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free weights / KV cache where the engine supports it (GPU); generation refuses until wake_up."""
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    def shutdown(self) -> None:
        """Stop the engine's loop (backends stop their engines first)."""
        self.loop.close()

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
        with self.updating(version) as progress:
            self._load_weights(progress.track(weights))
        return version

    @contextlib.contextmanager
    def updating(self, version: int, progress: Optional[UpdateProgress] = None):
        """Pause (`update_mode`, unless the caller paused already) → the block loads → `version` → resume.

        The block marks `progress.touched` once a tensor may have reached the model. On failure the
        version stays; with `touched` the engine also ends its in-flight requests and refuses new
        ones (`broken`) until an update succeeds. The error is re-raised.
        """
        progress = progress or UpdateProgress()
        with self._update_lock:
            pause_here = not self.paused
            if pause_here:
                self.run_sync(self.pause(self.update_mode))
            try:
                yield progress
                self.run_sync(self._commit(version))
            except BaseException as exc:
                if progress.touched:
                    self.run_sync(self._break(version, exc))
                raise
            finally:
                if pause_here:
                    self.run_sync(self.resume())

    def update_on_loop(self, version: int, load, progress: Optional[UpdateProgress] = None):
        """`updating` for a load that is a coroutine of the engine's loop (`load()` makes it; an engine whose
        model lives in another process): pause, load, version and resume run as one call on the loop, one
        hand-over between threads instead of four. Returns what the load returned."""
        progress = progress or UpdateProgress()
        with self._update_lock:
            return self.run_sync(self._update(version, load, progress))

    async def _update(self, version: int, load, progress: UpdateProgress):
        """The steps of `updating`, on the engine loop."""
        pause_here = not self.paused
        if pause_here:
            await self.pause(self.update_mode)
        try:
            result = await load()
            await self._commit(version)
            return result
        except BaseException as exc:
            if progress.touched:
                await self._break(version, exc)
            raise
        finally:
            if pause_here:
                await self.resume()

    async def _commit(self, version: int) -> None:
        await self.loop.call(self._set_version(version))
        self.version, self.broken = version, None

    async def _break(self, version: int, exc: BaseException) -> None:
        async def run():
            self.broken = (
                f"a weight update to policy version {version} failed after some tensors were loaded"
                f" ({type(exc).__name__}: {exc}); the model now mixes two versions, so this engine"
                f" refuses requests until an update succeeds (its version is still {self.version})"
            )
            await self._abort_known(list(self._requests))

        await self.loop.call(run())

    async def _set_version(self, version: int) -> None:  # noqa: B027 -- optional hook: engines that label tokens override it
        """On the engine loop, while paused: tokens generated from now on carry `version`."""

    @abstractmethod
    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy the tensors into the model in place and drop caches derived from old weights."""


def _check_mode(mode: str, what: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"{what} {mode!r} is unknown; pick one of {', '.join(PAUSE_MODES)}")


def check_specs(
    expected: dict[str, tuple[int, ...]],
    specs: Iterable[HFSpec | tuple],
    *,
    partial: bool = False,
    engine: str = "engine",
) -> None:
    """Names and shapes of an update against the model's; the error names the tensor and the fix."""
    seen = set()
    for spec in specs:
        name, shape = (spec.name, spec.shape) if isinstance(spec, HFSpec) else (spec[0], tuple(spec[1]))
        if name not in expected:
            close = difflib.get_close_matches(name, list(expected), n=3)
            raise WeightUpdateError(
                f"weight update has tensor {name!r}, which the {engine} model does not have"
                f"{f' (closest: {close})' if close else ''}; nothing was loaded, the engine keeps serving"
                " the previous version. Are the trainer and the engine built from the same architecture?"
            )
        if tuple(shape) != tuple(expected[name]):
            raise WeightUpdateError(
                f"weight update has tensor {name!r} with shape {tuple(shape)}, but the {engine} model expects"
                f" {tuple(expected[name])}; nothing was loaded, the engine keeps serving the previous version."
                " Do the trainer's and the engine's config.json match?"
            )
        if name in seen:
            raise WeightUpdateError(f"weight update has tensor {name!r} twice; nothing was loaded")
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing and not partial:
        raise WeightUpdateError(
            f"weight update lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}; nothing was loaded"
            " (pass partial=True to update a subset)"
        )
