"""Chat-template rendering for agent loops: the prompt, and the delta tokens of each observation.

Owns `ChatRenderer`. Token-in, token-out: the engine's tokens are never re-tokenized; what the
template adds around a tool / user / environment turn is rendered with the model's own chat template
(`apply_chat_template(..., tools=...)`) and only the delta is tokenized and appended:

    observation tokens = glue (the end of the assistant turn the model did not generate itself,
                                e.g. the "\\n" after `<|im_end|>` in ChatML)
                       + delta (render(base + new messages, generation prompt) minus render(base))

where `base` is a fixed user + assistant exchange, so the delta is exactly what the template puts
between an assistant turn and the next generation prompt. A template whose rendering of a longer
conversation does not start with that of the shorter one cannot give deltas: it fails here, naming
the template. Imports nothing heavy (the tokenizer is any HF tokenizer).
"""

from __future__ import annotations

from typing import Optional, Sequence

SENTINEL = "\u2063MEGARL_TURN\u2063"
"""Content of the base assistant turn, used to find where the template's end-of-turn text begins."""
_BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]


class ChatRenderer:
    """Render prompts and observation deltas with one tokenizer's chat template and tool list."""

    def __init__(self, tokenizer, tools: Optional[Sequence[dict]] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "agent loops render turns with the tokenizer's chat template, but it has none;"
                " use a chat model's tokenizer (or set tokenizer.chat_template)"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._before = self.render(_BASE, generation_prompt=False)
        if SENTINEL not in self._before:
            raise ValueError("the chat template drops assistant content; cannot find where an assistant turn ends")
        self.turn_end = self._before[self._before.rindex(SENTINEL) + len(SENTINEL) :]
        """Template text after an assistant turn's content (ChatML: `<|im_end|>\\n`)."""
        self.turn_end_ids = self.encode(self.turn_end)

    def render(self, messages: Sequence[dict], *, generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The prompt's tokens: messages (and tools) rendered, plus the generation prompt."""
        return self.encode(self.render(messages))

    def delta_text(self, messages: Sequence[dict]) -> str:
        """What the template renders for `messages` after an assistant turn, up to the generation prompt."""
        after = self.render(_BASE + list(messages))
        if not after.startswith(self._before):
            raise ValueError(
                "the chat template renders a conversation differently once messages follow it, so"
                " observation tokens cannot be appended as a delta; use a prefix-stable template"
                f" (rendered {after[:200]!r}... after {self._before[:200]!r}...)"
            )
        return after[len(self._before) :]

    def glue_ids(self, model_ids: Sequence[int]) -> list[int]:
        """The end-of-turn tokens the model did not generate (all of them after a turn cut by length)."""
        end = self.turn_end_ids
        for k in range(min(len(end), len(model_ids)), 0, -1):
            if list(model_ids[-k:]) == end[:k]:
                return end[k:]
        return list(end)

    def observation_ids(self, model_ids: Sequence[int], messages: Sequence[dict]) -> list[int]:
        """Tokens to append after a model turn so the next generation sees `messages` answered."""
        return self.glue_ids(model_ids) + self.encode(self.delta_text(messages))
