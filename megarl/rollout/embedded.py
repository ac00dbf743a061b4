"""The embedded rollout engine: `transformers` in-process, for where vLLM is absent.

Owns: `EmbeddedEngine`. A plain KV-cached sampling loop over an `AutoModelForCausalLM` (greedy,
temperature, top-k, top-p, stop tokens, per-request seeds); requests are grouped by prompt
length and sampling params so no padding enters the attention (greedy output equals
`transformers.generate` on the single prompt). Log-probs are those of the distribution each token
was sampled from: log_softmax(logits / temperature) after top-k / top-p (greedy: temperature 1),
as vLLM's "processed_logprobs" (`SamplingParams.logprobs`).
Weight updates copy HF-named tensors into the parameters (`named_parameters`, so tied
embeddings are one tensor), strict names and shapes; a sharding manager's sync lands in the engine's
own buffers (on CPU or its GPU), which become the parameters themselves (`load_buckets`), so later
syncs write straight into the model. Names are the checkpoint's (what
`save_pretrained` writes, vLLM loads and the sharding manager sends): for MoE families, whose
transformers modules fuse the experts ([experts, 2·ffn, hidden] gate-up, [experts, hidden, ffn]
down), each per-expert name is a view into the fused parameter (`checkpoint_params`). The fallback, not the default:
`megarl.rollout.create_engine` picks vLLM wherever it imports.

Scheduling (`batcher.BatchScheduler`): one batch at a time in a worker thread; a request arriving
meanwhile joins the next batch. Between two forward passes a batch meets the engine's pauses and
aborts: paused in mode keep it parks (weights load meanwhile; it then recomputes its KV cache on
the new weights and continues, its later tokens stamped with the new version), aborted rows end
with their partial output.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import torch

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams, make_completion
from megarl.rollout.batcher import BatchScheduler, Pending
from megarl.rollout.sharding import copysum
from megarl.rollout.sharding.plan import HFSpec
from megarl.rollout.sharding.protocol import FlatBucket, PendingCheck
from megarl.rollout.sharding.transport import KeptBuffers


def checkpoint_params(model) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names; MoE experts as views of the fused tensors."""
    from megarl.models.mapping import EXPERT
    from megarl.models.weight_map import MOE_HF_NAMES

    params = dict(model.named_parameters())
    names = MOE_HF_NAMES.get(model.config.model_type)
    if names is None:
        return params
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        params[prefix + names.router] = params.pop(prefix + "mlp.gate.weight")
        # detached views share the parameters' storage without autograd's view tracking
        gate_up = params.pop(prefix + "mlp.experts.gate_up_proj").detach()
        down = params.pop(prefix + "mlp.experts.down_proj").detach()
        ffn = gate_up.shape[1] // 2
        for expert in range(gate_up.shape[0]):
            gate, up = gate_up[expert, :ffn], gate_up[expert, ffn:]  # transformers: gate, up = (x @ W.T).chunk(2)
            for template, view in ((names.gate, gate), (names.up, up), (names.down, down[expert])):
                params[prefix + template.replace(EXPERT, str(expert))] = view
    return params


class EmbeddedEngine(RolloutEngine):
    """A `transformers` causal LM behind the rollout-engine API (CPU or one GPU)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        update_mode: str = "keep",
    ):
        super().__init__(update_mode=update_mode)
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # sampling runs in a thread of its own,
            self.device = torch.device("cuda", torch.cuda.current_device())  # whose current device is 0
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()
        self._params = checkpoint_params(self.model)
        # a sync's buckets land here and become the parameters (`load_buckets`)
        self.update_buffers = KeptBuffers(self.device)
        self._weights_lock = threading.Lock()  # a forward pass never sees half-loaded weights
        self._scheduler = BatchScheduler(self._run_batch, lambda pending: _aborted_before_start(pending, self.version))

    def describe(self) -> str:
        return f"embedded ({Path(self.model_path).name})"

    # -- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self._params.items()}

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._copy_in((name, tensor, None) for name, tensor in weights)

    def load_checked(self, items: Iterable[tuple[str, torch.Tensor, Optional[PendingCheck]]], version: int) -> int:
        """`load` of (name, tensor, its pending checksum check or None) (`protocol.pending_tensors`): a tensor
        with a check is copied and checked in one pass (`PendingCheck.copy_into`)."""
        with self.updating(version) as progress:
            self._copy_in(progress.track(items))
        return version

    def _copy_in(self, items: Iterable[tuple[str, torch.Tensor, Optional[PendingCheck]]]) -> None:
        with torch.no_grad(), self._weights_lock:
            for name, tensor, check in items:
                if check is None:
                    copysum.copy_into(self._params[name], tensor)
                else:
                    check.copy_into(self._params[name])

    def adopts_update(self, specs: Sequence[HFSpec]) -> bool:
        """Whether a sync of these tensors can land in `update_buffers` and become the parameters
        (`load_buckets`): each a whole parameter (not a view of fused MoE experts) of its dtype, where the
        engine keeps it (on CPU, or on its GPU while awake: the buckets are then kept there too,
        `KeptBuffers(device)`; asleep, its parameters are on the CPU and a sync is copied in)."""
        params = self._params
        whole = all(isinstance(params.get(s.name), torch.nn.Parameter) for s in specs)
        return whole and all(params[s.name].dtype == s.dtype and params[s.name].device == self.device for s in specs)

    def load_buckets(self, buckets: Iterable[FlatBucket], version: int) -> int:
        """Take already-checked buckets, landed in this engine's `update_buffers`, as policy `version`.

        A bucket's tensors become the parameters themselves (`param.data` rebound to the views; kept
        buckets only, of the same shape); from then on a sync writes straight into the model and each
        tensor arrives as the parameter's own memory: nothing to copy. Only syncs into this engine write
        into its buffers, each while the weights lock is held here, but one that fails before its first
        bucket arrives may already have written some: the update counts as touched from its start (a
        failure leaves the engine refusing requests until an update succeeds, never mixing versions
        silently).
        """
        with self.updating(version) as progress, torch.no_grad(), self._weights_lock:
            progress.touched = True
            for bucket in buckets:
                if bucket.kept and bucket.expected is None and self._written_in_place(bucket):
                    continue  # every tensor adopted at an earlier sync: no views to make (~4 µs each on a GPU)
                for name, tensor in bucket.tensors():
                    self._take(name, tensor, adopt=bucket.kept)
        return version

    def _written_in_place(self, bucket: FlatBucket) -> bool:
        """Whether each of the bucket's tensors is already its parameter's memory (`_take`'s first case)."""
        base, size, params = bucket.buffer.data_ptr(), bucket.buffer.element_size(), self._params
        return all(params[e.name].data_ptr() == base + e.offset * size for e in bucket.entries)

    def _take(self, name: str, tensor: torch.Tensor, *, adopt: bool) -> None:
        param = self._params[name]
        if param.data_ptr() == tensor.data_ptr():
            return  # adopted at an earlier sync: written in place
        if adopt and param.shape == tensor.shape and param.dtype == tensor.dtype and param.device == tensor.device:
            param.data = tensor
        else:
            param.copy_(tensor)

    def sleep(self) -> None:
        """On GPU, move weights to CPU; on CPU there is nothing to free (a flag only)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            self._params = checkpoint_params(self.model)  # `to` gives parameters new storage: fresh expert views
            self.update_buffers.clear()  # the adopted GPU buckets go too (a sender holding them as well keeps none)
            torch.cuda.empty_cache()
        super().sleep()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
            self._params = checkpoint_params(self.model)
        super().wake_up()

    # -- requests (engine loop) -------------------------------------------------------------
    async def _generate(self, prompt, params, request_id):
        return await self._scheduler.submit(prompt, params, request_id)

    async def _abort(self, request_ids):
        self._scheduler.abort(request_ids)

    async def _pause(self, mode):
        await self._scheduler.pause(mode)

    async def _resume(self):
        await self._scheduler.resume()

    # -- batches (worker thread) ------------------------------------------------------------
    def _run_batch(self, batch: list[Pending]) -> list[list[Completion]]:
        """Requests grouped by prompt length and params but the seed (no padding enters the attention): one
        forward pass per group, each request's rows sampling from its own seed's generator.

        Requests that differ only in their seeds share a batch: the trainer seeds every prompt row apart
        (`trainer.loop.step_seed`), and a batch per seed ran the quickstart's 16 prompts × 8 samples as 16
        batches of 8 rows (81 ms a step's generation against 20 ms as one batch of 128)."""
        results: list[list[Completion]] = [[] for _ in batch]
        groups = defaultdict(list)
        for i, pending in enumerate(batch):
            groups[(len(pending.prompt), replace(pending.params, seed=None))].append(i)
        for (_, params), members in groups.items():
            rows = [i for i in members for _ in range(params.n)]
            completions = self._sample(
                [batch[i].prompt for i in rows],
                params,
                [batch[i].request_id for i in rows],
                [batch[i].params.seed for i in rows],
            )
            for j, i in enumerate(members):
                results[i] = completions[j * params.n : (j + 1) * params.n]
        return results

    @torch.no_grad()
    def _sample(
        self, prompts: list[list[int]], params: SamplingParams, ids: list[str], seeds: list[Optional[int]]
    ) -> list[Completion]:
        """One batch of equal-length prompts, KV-cached, until every row ended or max_tokens; row i samples
        from the generator of `seeds[i]` (`_Draws`).

        Before every forward pass the gate may park the batch (pause keep) or end rows (abort). When
        the weights changed while it was parked, the KV cache is recomputed on the new weights from
        the prompt and the tokens so far (a fresh run from that prefix), as vLLM recomputes its
        preempted requests."""
        draws = _Draws(seeds, self.device)
        rows = _Rows(torch.tensor(prompts, device=self.device), params)
        past, version, token = None, None, None
        for _ in range(params.max_tokens):
            aborted = self._scheduler.gate.checkpoint(ids)  # parks here while paused (keep)
            rows.abort(i for i, r in enumerate(ids) if r in aborted)
            if rows.all_ended():
                break
            with self._weights_lock:
                if version != self.version:  # first pass, or new weights: (re)compute from the whole prefix
                    version = self.version
                    logits, past = self._forward(rows.sequences(), None)
                else:
                    logits, past = self._forward(token[:, None], past)
            token, logp = _pick(logits, params, draws)
            rows.append(token, logp, version)
            if rows.all_ended():
                break
        return rows.completions(self.version)

    def _forward(self, ids: torch.Tensor, past):
        out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
        return out.logits[:, -1].float(), out.past_key_values

    @torch.no_grad()
    def _score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        scores = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], device=self.device)
            with self._weights_lock:
                logits = self.model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1)
            scores.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return scores


class _Rows:
    """The rows of one sampling batch: tokens, log-probs and versions so far, and where each row ended."""

    def __init__(self, prompts: torch.Tensor, params: SamplingParams):
        self.prompts, self.params = prompts, params
        self.stops = torch.tensor(list(params.stop_token_ids) or [-1], device=prompts.device)
        self.tokens: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.ends: list[Optional[tuple[int, str]]] = [None] * len(prompts)

    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompts, *(t[:, None] for t in self.tokens)], 1)

    def append(self, token: torch.Tensor, logp: torch.Tensor, version: int) -> None:
        self.tokens.append(token)
        self.logps.append(logp)
        self.versions.append(version)
        for i in torch.isin(token, self.stops).nonzero()[:, 0].tolist():
            if self.ends[i] is None:
                self.ends[i] = (len(self.tokens), "stop")

    def abort(self, rows: Iterable[int]) -> None:
        for i in rows:
            if self.ends[i] is None:
                self.ends[i] = (len(self.tokens), "abort")

    def all_ended(self) -> bool:
        return all(e is not None for e in self.ends) or len(self.tokens) == self.params.max_tokens

    def completions(self, current_version: int) -> list[Completion]:
        tokens = torch.stack(self.tokens, 1).tolist() if self.tokens else [[] for _ in self.ends]
        logps = torch.stack(self.logps, 1).tolist() if self.logps else [[] for _ in self.ends]
        out = []
        for row_tokens, row_logps, end in zip(tokens, logps, self.ends):
            stop, reason = end if end is not None else (len(row_tokens), "length")
            out.append(
                make_completion(
                    row_tokens[:stop],
                    row_logps[:stop] if self.params.logprobs else None,
                    reason,
                    self.versions[:stop],
                    current_version,
                )
            )
        return out


def _aborted_before_start(pending: Pending, version: int) -> list[Completion]:
    return [Completion([], [] if pending.params.logprobs else None, "abort", version) for _ in range(pending.params.n)]


class _Draws:
    """The random draws of a batch's rows: a generator per seed (rows without one share a randomly
    seeded one), and each seed's rows drawn together, in row order. A request thus samples what it
    would alone in a batch of its own (given the same probabilities)."""

    def __init__(self, seeds: Sequence[Optional[int]], device):
        by_seed: dict[Optional[int], list[int]] = defaultdict(list)
        for row, seed in enumerate(seeds):
            by_seed[seed].append(row)
        self.parts = []
        for seed, rows in by_seed.items():
            generator = torch.Generator(device=device)
            generator.manual_seed(seed if seed is not None else torch.seed())
            self.parts.append((generator, torch.tensor(rows, device=device)))

    def multinomial(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of `probs` ([rows, vocab])."""
        if len(self.parts) == 1:
            return torch.multinomial(probs, 1, generator=self.parts[0][0])[:, 0]
        token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for generator, rows in self.parts:
            token[rows] = torch.multinomial(probs[rows], 1, generator=generator)[:, 0]
        return token


def _pick(logits: torch.Tensor, params: SamplingParams, draws: _Draws) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token, its log-prob) per row: argmax when greedy (log-prob at temperature 1), else a
    sample of the temperature / top-k / top-p distribution and its log-prob under that distribution."""
    if params.greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
    scaled = _truncated(logits / params.temperature, params)
    token = draws.multinomial(scaled.softmax(-1))
    return token, torch.log_softmax(scaled, -1).gather(-1, token[:, None])[:, 0]


def _truncated(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p (the smallest set of top tokens holding ≥ top_p of the mass), as vLLM: -inf elsewhere."""
    if params.top_k and params.top_k > 0:
        kth = scaled.topk(min(params.top_k, scaled.shape[-1]), -1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # the mass above a token already reaches top_p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled
