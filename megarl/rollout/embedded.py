"""The embedded rollout engine: `transformers` in-process, for where vLLM is absent.

Owns: `EmbeddedEngine`. A plain KV-cached sampling loop over an `AutoModelForCausalLM` (greedy,
temperature, top-k, top-p, stop tokens, per-request seeds); requests are grouped by prompt
length and sampling params so no padding enters the attention (greedy output equals
`transformers.generate` on the single prompt). Log-probs are those of the distribution each token
was sampled from: log_softmax(logits / temperature) after top-k / top-p (greedy: temperature 1),
as vLLM's "processed_logprobs" (`SamplingParams.logprobs`).
Weight updates copy HF-named tensors into the parameters (`named_parameters`, so tied
embeddings are one tensor), strict names and shapes. Names are the checkpoint's (what
`save_pretrained` writes, vLLM loads and the sharding manager sends): for MoE families, whose
transformers modules fuse the experts ([experts, 2·ffn, hidden] gate-up, [experts, hidden, ffn]
down), each per-expert name is a view into the fused parameter (`checkpoint_params`). The fallback, not the default:
`megarl.rollout.create_engine` picks vLLM wherever it imports.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import torch

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams


def checkpoint_params(model) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names; MoE experts as views of the fused tensors."""
    from megarl.models.mapping import EXPERT, MOE_HF_NAMES

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

    def __init__(self, model_path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()
        self._params = checkpoint_params(self.model)

    def describe(self) -> str:
        return f"embedded ({Path(self.model_path).name})"

    # -- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self._params.items()}

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                self._params[name].copy_(tensor)

    def sleep(self) -> None:
        """On GPU, move weights to CPU; on CPU there is nothing to free (a flag only)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        super().sleep()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        super().wake_up()

    # -- generation -------------------------------------------------------------------------
    def _generate_requests(self, requests):
        results: list[list[Completion]] = [[] for _ in requests]
        groups = defaultdict(list)
        for i, (prompt, params) in enumerate(requests):
            groups[(len(prompt), params)].append(i)
        for (_, params), members in groups.items():
            prompts = [requests[i][0] for i in members for _ in range(params.n)]
            completions = self._sample(prompts, params)
            for j, i in enumerate(members):
                results[i] = completions[j * params.n:(j + 1) * params.n]
        return results

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One batch of equal-length prompts, KV-cached, until every row stopped or max_tokens."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        ids = torch.tensor(prompts, device=self.device)
        stops = torch.tensor(list(params.stop_token_ids) or [-1], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
        tokens, logps = [], []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        for _ in range(params.max_tokens):
            token, logp = _pick(logits, params, generator)
            tokens.append(token)
            logps.append(logp)
            done |= torch.isin(token, stops)
            if bool(done.all()) or len(tokens) == params.max_tokens:
                break
            out = self.model(input_ids=token[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
        return _completions(torch.stack(tokens, 1), torch.stack(logps, 1), stops, params)

    @torch.no_grad()
    def _score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        scores = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], device=self.device)
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), -1)
            scores.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return scores


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token, its log-prob) per row: argmax when greedy (log-prob at temperature 1), else a
    sample of the temperature / top-k / top-p distribution and its log-prob under that distribution."""
    if params.greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
    scaled = _truncated(logits / params.temperature, params)
    token = torch.multinomial(scaled.softmax(-1), 1, generator=generator)[:, 0]
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


def _completions(tokens: torch.Tensor, logps: torch.Tensor, stops: torch.Tensor, params) -> list[Completion]:
    out = []
    for row_tokens, row_logps in zip(tokens.tolist(), logps.tolist()):
        end = next((i + 1 for i, t in enumerate(row_tokens) if t in params.stop_token_ids), None)
        reason = "stop" if end is not None else "length"
        end = end or len(row_tokens)
        out.append(Completion(row_tokens[:end], row_logps[:end] if params.logprobs else None, reason))
    return out
