"""Tool-call demonstrations for an SFT warm-up before tool-agent RL (the tool quickstart and its test).

Owns `tool_call_examples(rows, tokenizer, schemas, ...)`: (token ids, prompt length) pairs in the
exact token layout the `tool_agent` loop produces (`megarl.agent.chat.ChatRenderer`: the prompt
rendered with the tools, the model's turn, then the tool turn's template delta tokens), so a policy
warmed up on them meets at rollout the very token sequences it was taught. Per row, with probability
`call_share` the teacher calls the calculator (turn 1: a Hermes `<tool_call>` with the row's
expression; turn 2, after the tool's answer: the answer), otherwise it guesses (the answer with one
digit changed: a teacher who cannot multiply in its head). The share gives RL room: a warmed-up policy
calls the tool only sometimes, and the reward says which habit pays. Imports the agent package's
chat renderer; the examples feed `megarl.trainer.sft.sft_warmup`.
"""

from __future__ import annotations

import json
import random
from typing import Sequence

from megarl.agent.chat import ChatRenderer


def call_text(expression: str, tool: str = "calculator", arguments_first: bool = False) -> str:
    """The Hermes tool call the teacher writes (what the tiny chat template renders for a tool call).
    `arguments_first` writes the JSON's "arguments" before "name" (the parser takes either order): the
    copied expression then sits 23 tokens nearer the prompt it is copied from, which a 2-layer model
    learns to copy in ~200 steps instead of stalling at chance for 1200 (measured on the tool quickstart)."""
    call = {"name": tool, "arguments": {"expression": expression}}
    if arguments_first:
        call = {"arguments": call["arguments"], "name": tool}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def guessed_answer(answer: str, rng: random.Random) -> str:
    """`answer` with one digit replaced by another (never the answer itself)."""
    digits = list(answer)
    spots = [i for i, ch in enumerate(digits) if ch.isdigit()]
    i = rng.choice(spots)
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i > 0 or d != "0" or len(spots) == 1)])
    return "".join(digits)


def tool_call_examples(
    rows: Sequence[dict],
    tokenizer,
    schemas: Sequence[dict],
    *,
    call_share: float = 0.5,
    seed: int = 0,
    arguments_first: bool = False,
) -> list[tuple[list[int], int]]:
    """SFT examples from rows with `prompt` (a string or messages), `ground_truth` and
    `extra_info.expression`: two examples per calling row (the call, written by `call_text`; the answer
    after the tool's result), one per guessing row."""
    if not 0.0 <= call_share <= 1.0:
        raise ValueError(
            f"call_share must be in [0, 1] (the share of demonstrations that call the tool), got {call_share}"
        )
    renderer = ChatRenderer(tokenizer, schemas)
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    examples = []
    for row in rows:
        messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        prompt = renderer.prompt_ids(messages)
        answer = str(row["ground_truth"])
        if rng.random() >= call_share:
            examples.append((prompt + renderer.encode(guessed_answer(answer, rng)) + [eos], len(prompt)))
            continue
        call = renderer.encode(call_text(row["extra_info"]["expression"], arguments_first=arguments_first)) + [eos]
        examples.append((prompt + call, len(prompt)))
        context = prompt + call + renderer.observation_ids(call, [{"role": "tool", "content": answer}])
        examples.append((context + renderer.encode(answer) + [eos], len(context)))
    return examples
