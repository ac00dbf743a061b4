"""Every column a training batch can hold, declared once: name, kind, shape, who writes it, meaning.

A batch goes from the prompt dataset through the rollout, the rewards, the model roles and the
advantage estimator to the losses; each phase adds its columns. `ROLLOUT` lists them all, and a
`Batch` built with this schema refuses a column it does not declare (a misspelt name fails where it
is written, with the closest declared names) and a column of the wrong kind or rank.

Shapes: B rows (samples), L = prompt + response columns (prompt left-padded, response
right-padded), T = response columns (the last T of L). Kinds: "int" (any integer dtype), "float"
(any floating dtype), "object" (a numpy object array of Python values: strings, dicts, lists).

Columns a dataset file carries beside the prompt (e.g. `extra_info`, an `agent_name`, a user's
`index`) pass through as object columns: the dataset declares them (`Schema.with_data_columns`).
Imports torch and numpy only.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

KINDS = ("int", "float", "object")


@dataclass(frozen=True)
class Column:
    """One declared column."""

    kind: str
    """int, float or object (see the module docstring)."""
    dims: str
    """Its shape by named dimensions: "B", "B,L" or "B,T"."""
    writer: str
    """The phase that writes it."""
    doc: str
    """What it holds."""

    @property
    def ndim(self) -> int:
        return len(self.dims.split(","))


def _c(kind: str, dims: str, writer: str, doc: str) -> Column:
    return Column(kind, dims, writer, doc)


ROLLOUT_COLUMNS: dict[str, Column] = {
    # -- the prompt dataset (megarl.data.datasets) -------------------------------------------------
    "input_ids": _c("int", "B,L", "dataset, rollout", "prompt ids (left-padded); the rollout appends the response"),
    "attention_mask": _c("int", "B,L", "dataset, rollout", "1 on real prompt and response tokens"),
    "position_ids": _c("int", "B,L", "dataset", "prompt positions (dropped once responses are appended)"),
    "raw_prompt": _c("object", "B", "dataset", "the prompt as written in the file (a string or chat messages)"),
    "ground_truth": _c("object", "B", "dataset", "the reference answer the reward compares with"),
    "data_source": _c("object", "B", "dataset", "which reward function scores the row"),
    "dataset_index": _c("object", "B", "dataset", "the row's index in its dataset"),
    "extra_info": _c("object", "B", "dataset", "per-row extras handed to the reward function"),
    # -- rollout (megarl.trainer.batching) ---------------------------------------------------------
    "response_mask": _c(
        "int",
        "B,T",
        "rollout",
        "1 on response tokens the policy generated (0: padding, and tool / user / environment tokens between turns)",
    ),
    "rollout_log_probs": _c("float", "B,T", "rollout", "the engine's log-prob of each sampled token"),
    "uid": _c("object", "B", "rollout", "prompt group id (samples of one prompt share it)"),
    "finish_reason": _c("object", "B", "rollout", "stop or length"),
    "policy_version": _c("int", "B", "rollout", "oldest policy version (optimizer step) among the row's tokens"),
    "response_versions": _c("int", "B,T", "rollout", "policy version of each generated token (-1: not generated)"),
    "turn_rewards": _c("float", "B,T", "rollout", "per-turn rewards (environments, tools) on each turn's last token"),
    "reward_extras": _c("object", "B", "rollout", "what the agent loop learned for the reward (tool rewards, ...)"),
    "agent_turns": _c("object", "B", "rollout", "per-turn records of multi-turn rows (None for one turn)"),
    "agent_name": _c("object", "B", "dataset", "the agent loop of the row (default: rollout.agent.default_agent)"),
    # -- rewards (trainer loop, megarl.rewards, the reward model) ----------------------------------
    "response_text": _c("object", "B", "reward", "the decoded response the reward function read"),
    "scores": _c("float", "B", "reward", "outcome score per row (rule + reward model + shaping)"),
    "acc": _c("float", "B", "reward", "1 when the answer is right (accuracy metrics)"),
    "reward_info": _c("object", "B", "reward", "the reward fn's other entries per row (dict; logged as means)"),
    "rm_scores": _c("float", "B", "reward_model", "the reward model's score at the last response token"),
    "baseline_rewards": _c("float", "B", "reward", "score of the greedy response to the same prompt (ReMax)"),
    "token_level_scores": _c("float", "B,T", "reward", "the score placed on the last response token"),
    # -- model roles (megarl.workers) --------------------------------------------------------------
    "old_log_probs": _c("float", "B,T", "actor", "log-probs of the policy before this step's update"),
    "entropy": _c("float", "B,T", "actor", "policy entropy at each response position"),
    "ref_log_probs": _c("float", "B,T", "ref", "log-probs of the frozen reference policy"),
    "values": _c("float", "B,T", "critic", "V(s_t) before each response token"),
    # -- advantages (megarl.algorithms) ------------------------------------------------------------
    "token_level_rewards": _c("float", "B,T", "advantages", "token scores minus the KL penalty (if in the reward)"),
    "advantages": _c("float", "B,T", "advantages", "the estimator's advantage per response token"),
    "returns": _c("float", "B,T", "advantages", "the estimator's return (the critic's target)"),
    "is_weights": _c("float", "B,T", "advantages", "truncated rollout/train importance weights"),
}


@dataclass(frozen=True)
class Schema:
    """The columns a batch may hold; `check` refuses anything else."""

    name: str
    columns: dict[str, Column] = field(repr=False)

    def with_data_columns(self, names: Iterable[str]) -> "Schema":
        """This schema plus the dataset's pass-through columns (object, one value per row)."""
        extra = {
            n: _c("object", "B", "dataset", "a column of the data file, passed through")
            for n in names
            if n not in self.columns
        }
        return self if not extra else Schema(self.name, {**self.columns, **extra})

    def check(self, name: str, value) -> None:
        """Raise naming the column and the fix when `value` may not be column `name`."""
        column = self.columns.get(name)
        if column is None:
            close = difflib.get_close_matches(name, list(self.columns), n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise KeyError(
                f"{self.name} batch has no column {name!r}; {hint}declared columns are listed in"
                " megarl.data.schema (declare a new one there, with its kind, shape and writer)"
            )
        kind = _kind_of(value)
        if kind != column.kind or value.ndim != column.ndim:
            raise TypeError(
                f"batch column {name!r} must be {column.kind} [{column.dims}] ({column.doc}); got"
                f" {kind} with shape {list(value.shape)}"
            )


def _kind_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "float" if value.is_floating_point() else "int"
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.number):
        return "float" if np.issubdtype(value.dtype, np.floating) else "int"
    return "object"


ROLLOUT = Schema("rollout", ROLLOUT_COLUMNS)
"""The schema of the batch the RL loop trains on (prompts → rollout → rewards → roles → losses)."""
