"""`ReplayLLM`: an `AgentLLM` that answers with given responses, scored by a real engine.

Forced decoding: each `generate` takes the next scripted response (text or token ids), cuts it at
the request's stop tokens and max_tokens as an engine would, and returns it with the engine's own
log-probs of those tokens (`engine.score`, teacher forcing on prompt + response) and the engine's
policy version. Uses: replaying recorded or expert conversations through an agent loop (tool-use
demonstrations become scored trajectories), and tests and demos that need a model to call tools
before any model has learnt to. Imports the rollout contract only.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Optional, Sequence

from megarl.rollout.base import Completion, SamplingParams


class ReplayLLM:
    """Replays `responses` in order, one per `generate` call; raises when they run out."""

    def __init__(self, engine, tokenizer, responses: Sequence[str | Sequence[int]], session_id: Optional[str] = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.responses = list(responses)
        self.session_id = session_id or uuid.uuid4().hex
        self.calls = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        if self.calls >= len(self.responses):
            raise RuntimeError(f"ReplayLLM has only {len(self.responses)} responses; turn {self.calls + 1} was asked")
        response = self.responses[self.calls]
        self.calls += 1
        ids = self.tokenizer.encode(response, add_special_tokens=False) if isinstance(response, str) else list(response)
        stop = next((i + 1 for i, t in enumerate(ids) if t in params.stop_token_ids), None)
        ids = ids[: min(stop or len(ids), params.max_tokens)]
        if not ids:
            raise ValueError("a replayed response needs at least one token")
        scores = await asyncio.to_thread(self.engine.score, [list(prompt_ids) + ids])
        reason = "stop" if ids[-1] in params.stop_token_ids else "length"
        return Completion(ids, scores[0][-len(ids) :] if params.logprobs else None, reason, self.engine.version)
