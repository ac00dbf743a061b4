"""A tiny character-level tokenizer for tests, CI and the quickstart (no download needed).

Owns `build_tiny_tokenizer`: one token per printable ASCII character plus newline and tab, the
special tokens `<pad>`, `<unk>`, `<s>`, `</s>`, `<|im_start|>`, `<|im_end|>`, and a ChatML chat
template that also renders tools, tool calls and tool results (Hermes style, as Qwen2.5 does). It is
a real `transformers.PreTrainedTokenizerFast`, so every code path that takes an HF tokenizer
(datasets, rollout, rewards, agent loops) runs unchanged with tiny models.
`load_tokenizer(path)` loads any saved tokenizer (the trainer uses it). Imports only `tokenizers` and
`transformers` (CPU, no megatron / vLLM / Ray).
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS, IM_START, IM_END]
CHARACTERS = "\n\t" + "".join(chr(c) for c in range(32, 127))  # newline, tab, printable ASCII

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Plain ChatML: what the tiny tokenizer renders for conversations without tools."""

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within"
    ' <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments":'
    " <args-json-object>}\n</tool_call>"
)
CHATML_TOOLS_TEMPLATE = (
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}"
    "{% set ns.start = 1 %}{% endif %}"
    "{{ '" + TOOLS_HEADER.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_FOOTER.replace("\n", "\\n") + "<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}{% set call = call['function'] if call.get('function') else call %}"
    "{% set args = call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + args + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML plus Hermes-style tools as Qwen2.5 renders them: a `# Tools` system section listing the
OpenAI function schemas in `<tools>`, assistant `tool_calls` as `<tool_call>{json}</tool_call>`, and
consecutive `tool` messages in one user turn of `<tool_response>` blocks. Without tools and tool
messages it renders exactly what `CHATML_TEMPLATE` renders."""

CHATML_COMPACT_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(', ')) + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}{% set call = call['function'] if call.get('function') else call %}"
    "{% set args = call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + args + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML with tools in few tokens, for tiny character-level models: a `Tools: name, ...` system line
(names only, no schemas), Hermes `<tool_call>{json}</tool_call>` calls, and each tool result as its own
`tool` turn. The full template's tool section costs ~600 characters per prompt; this one ~20, which
is what lets the tool quickstart's SFT warm-up and rollouts run in minutes on 2 cores."""

TEMPLATES = {"tools": CHATML_TOOLS_TEMPLATE, "compact_tools": CHATML_COMPACT_TOOLS_TEMPLATE}
"""Chat templates of the tiny tokenizer by name (`build_tiny_tokenizer(chat_template=...)`)."""

assert set(string.digits + string.ascii_letters + string.punctuation + " ") <= set(CHARACTERS)


def tiny_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first (so `<pad>` is 0), then one id per character."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}


def _backend() -> Tokenizer:
    # A BPE model with no merges splits text into single characters; no pre-tokenizer, so spaces
    # and newlines are ordinary characters, and the Fuse decoder joins tokens back without gaps.
    tok = Tokenizer(models.BPE(vocab=tiny_vocab(), merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def build_tiny_tokenizer(save_dir: str | None = None, chat_template: str = "tools"):
    """Build the character-level tokenizer; `save_pretrained` it to `save_dir` when given.

    eos is `<|im_end|>` (the end of a chat turn, so generation stops there), pad is `<pad>` (id 0),
    bos is `<s>` (never added automatically). `AutoTokenizer.from_pretrained(save_dir)` loads it.
    `chat_template`: a name in `TEMPLATES` (`tools`: Qwen2.5-style tool rendering; `compact_tools`).
    """
    if chat_template not in TEMPLATES:
        raise ValueError(f"chat_template must be one of {sorted(TEMPLATES)}, got {chat_template!r}")
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=IM_END,
        additional_special_tokens=[EOS, IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = TEMPLATES[chat_template]
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` values of tokenizers saved from a plain `tokenizers` object (as this module's is)."""


def load_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path)`, except that a tokenizer saved as a generic one (its
    tokenizer_config.json names a class in `GENERIC_CLASSES`) loads exactly as saved. transformers 5
    otherwise picks the class of config.json's `model_type` (Qwen2Tokenizer beside a tiny Qwen2) and
    rebuilds that family's byte-level pre-tokenizer, which silently drops every space and newline of
    the character tokenizer (so chat templates, tool calls and multi-line text stop round-tripping)."""
    import json
    from pathlib import Path

    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and (Path(path) / "tokenizer.json").is_file():
        if json.loads(config.read_text()).get("tokenizer_class") in GENERIC_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer  # imports the model mappings, generation and torch._dynamo (~2 s)

    return AutoTokenizer.from_pretrained(path)
