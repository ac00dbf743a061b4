"""What an agent loop returns: the exact tokens of one conversation and what happened in it.

Owns `Turn` (one assistant turn or one observation) and `Trajectory`: the prompt ids, the response
ids (every token after the prompt: the model's turns and the chat-template tokens of tool / user /
environment turns between them), a response mask (1 = the engine generated the token, 0 = it did
not), the rollout log-prob and policy version of every response token (0 and -1 at mask 0), the
per-turn records, the finish reason, per-turn rewards and reward extras, and per-trajectory metrics.
Tokens only ever grow by `add_model_turn` (an engine `Completion`, verbatim) and `add_observation`
(template tokens): nothing is re-tokenized from text. `summarize` turns a step's trajectories into
step metrics. Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

FINISH_REASONS = ("stop", "length", "max_turns", "tool_budget", "error")
"""stop: the model ended without asking for more; length: the response-token budget (or a turn's
max_tokens) ran out; max_turns: max_assistant_turns / max_user_turns reached; tool_budget: the
trajectory's tool-call budget ran out; error: the loop could not go on (an environment raised, the
chat template failed)."""


@dataclass
class Turn:
    """One turn of the conversation after the prompt, with where its tokens sit in the response."""

    role: str
    """assistant (the model), tool, user or env (an environment's answer)."""
    start: int
    """Index of the turn's first token in `Trajectory.response_ids`."""
    end: int
    """One past the turn's last token in `Trajectory.response_ids`."""
    text: str = ""
    """The turn's text (decoded model tokens, or the observation's message contents)."""
    tool_calls: list[dict] = field(default_factory=list)
    """Assistant turns: the parsed calls, {name, arguments, id, error}."""
    tool_results: list[dict] = field(default_factory=list)
    """Tool turns: per call {name, text, error kind or None, seconds}."""
    finish_reason: Optional[str] = None
    """Assistant turns: the engine's finish reason (stop or length)."""
    reward: Optional[float] = None
    """A reward given for this turn (environment step rewards), placed on the preceding model token."""
    seconds: float = 0.0
    """Wall-clock seconds the turn took (generation, or running the tools / the environment)."""
    version: Optional[int] = None
    """Assistant turns: the policy version of the weights that generated it."""


@dataclass
class Trajectory:
    """One conversation as training tokens; build it with `add_model_turn` / `add_observation`."""

    prompt_ids: list[int]
    """The prompt as the engine saw it (chat template applied, tools rendered)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt, model turns and observation tokens interleaved."""
    response_mask: list[int] = field(default_factory=list)
    """1 where the engine generated the token, 0 on tool / user / environment / template tokens."""
    response_logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated token; 0.0 at mask 0."""
    response_versions: list[int] = field(default_factory=list)
    """Policy version that generated each token; -1 at mask 0."""
    turns: list[Turn] = field(default_factory=list)
    """Per-turn records, in order."""
    finish_reason: str = "stop"
    """One of FINISH_REASONS."""
    reward_extras: dict[str, Any] = field(default_factory=dict)
    """Whatever the loop learned for the reward: tool rewards, the environment's return, the user
    agent's own result; handed to the reward function beside the row's extra_info."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-trajectory numbers the trainer averages per step (see `finalize`)."""
    error: Optional[str] = None
    """What went wrong when finish_reason is error."""

    # -- building ---------------------------------------------------------------------------------
    def add_model_turn(
        self,
        token_ids: list[int],
        logprobs: list[float],
        version: int,
        *,
        text: str = "",
        finish_reason: str = "stop",
        seconds: float = 0.0,
        versions: Optional[list[int]] = None,
    ) -> Turn:
        """Append an engine completion verbatim (mask 1, its log-probs, its version, or per token `versions`:
        a request that ran across a weight update switches version mid-turn)."""
        if len(logprobs) != len(token_ids):
            raise ValueError(
                f"a model turn has {len(token_ids)} tokens but {len(logprobs)} log-probs; agent loops"
                " need the engine's log-prob of every token (SamplingParams.logprobs=True)"
            )
        turn = self._extend(
            "assistant", token_ids, 1, logprobs, version, text=text, finish_reason=finish_reason, seconds=seconds
        )
        if versions is not None and len(versions) == len(token_ids):
            self.response_versions[turn.start : turn.end] = map(int, versions)
        turn.version = version
        return turn

    def add_observation(
        self,
        role: str,
        token_ids: list[int],
        *,
        text: str = "",
        seconds: float = 0.0,
        tool_results: Optional[list[dict]] = None,
    ) -> Turn:
        """Append tokens the model did not generate (mask 0, log-prob 0, version -1)."""
        return self._extend(
            role,
            token_ids,
            0,
            [0.0] * len(token_ids),
            -1,
            text=text,
            seconds=seconds,
            tool_results=list(tool_results or []),
        )

    def _extend(self, role, token_ids, mask, logprobs, version, **turn_fields) -> Turn:
        start = len(self.response_ids)
        self.response_ids.extend(map(int, token_ids))  # map: C loops, 3x a generator's speed on long turns
        self.response_mask.extend([mask] * len(token_ids))
        self.response_logprobs.extend(map(float, logprobs))
        self.response_versions.extend([version if mask else -1] * len(token_ids))
        turn = Turn(role, start, len(self.response_ids), **turn_fields)
        self.turns.append(turn)
        return turn

    def reward_turn(self, reward: float, turn: Optional[Turn] = None) -> None:
        """Give `reward` to the last assistant turn (or `turn`); it lands on that turn's last model token."""
        target = turn or next((t for t in reversed(self.turns) if t.role == "assistant"), None)
        if target is None or target.role != "assistant":
            raise ValueError("a turn reward needs an assistant turn to land on")
        target.reward = (target.reward or 0.0) + float(reward)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def num_turns(self) -> int:
        """Assistant (model) turns."""
        return sum(t.role == "assistant" for t in self.turns)

    def turn_rewards(self) -> list[tuple[int, float]]:
        """(response index of the turn's last model token, reward) for every rewarded assistant turn."""
        return [
            (t.end - 1, t.reward)
            for t in self.turns
            if t.role == "assistant" and t.reward is not None and t.end > t.start
        ]

    def token_rewards(self) -> list[float]:
        """The per-turn rewards as a dense list over the response (0 elsewhere)."""
        out = [0.0] * len(self.response_ids)
        for index, reward in self.turn_rewards():
            out[index] += reward
        return out

    def check(self) -> "Trajectory":
        """Raise if the parallel lists disagree or the finish reason is unknown; returns self."""
        n = len(self.response_ids)
        lengths = {len(self.response_mask), len(self.response_logprobs), len(self.response_versions)}
        if lengths != {n}:
            raise ValueError(f"trajectory lists disagree: {n} response ids, mask/logprobs/versions lengths {lengths}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if not self.prompt_ids:
            raise ValueError("a trajectory needs a non-empty prompt")
        return self

    def finalize(self, **extra_metrics: float) -> "Trajectory":
        """Fill the per-trajectory metrics (turns, tokens, masked share, ...) and check; returns self."""
        n = len(self.response_ids)
        self.metrics.update(
            {
                "turns": float(self.num_turns),
                "response_tokens": float(n),
                "model_tokens": float(sum(self.response_mask)),
                "masked_token_share": (n - sum(self.response_mask)) / n if n else 0.0,
                **{k: float(v) for k, v in extra_metrics.items()},
            }
        )
        return self.check()

    def to_record(self, tokenizer=None) -> dict[str, Any]:
        """A JSON-ready dict for rollouts/step_N.jsonl (with decoded texts when a tokenizer is given)."""
        record = dataclasses.asdict(self)
        record["num_turns"] = self.num_turns
        record["turn_rewards"] = self.turn_rewards()
        if tokenizer is not None:
            record["prompt_text"] = tokenizer.decode(self.prompt_ids)
            record["response_text"] = tokenizer.decode(self.response_ids)
        return record


def summarize(trajectories: list[Trajectory], prefix: str = "agent/") -> dict[str, float]:
    """Step metrics: the mean of each per-trajectory metric (over the trajectories that report it), the
    share of each finish reason, and the mean per-turn reward count."""
    if not trajectories:
        return {}
    sums: dict[str, list[float]] = {}
    for traj in trajectories:
        for key, value in traj.metrics.items():
            sums.setdefault(key, []).append(float(value))
    # wall-clock means (tool_seconds, env_seconds) go under time/, beside the phase times: they are the
    # metrics a rerun cannot reproduce, and resume comparisons skip that prefix
    out = {
        f"{'time/' + prefix if key.endswith('_seconds') else prefix}{key}": sum(values) / len(values)
        for key, values in sorted(sums.items())
    }
    for reason in FINISH_REASONS:
        out[f"{prefix}finish/{reason}"] = sum(t.finish_reason == reason for t in trajectories) / len(trajectories)
    out[f"{prefix}rewarded_turns"] = sum(len(t.turn_rewards()) for t in trajectories) / len(trajectories)
    return out
