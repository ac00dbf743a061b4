"""A tiny character-level tokenizer for tests, CI and the quickstart (no download needed).

Owns `build_tiny_tokenizer`: one token per printable ASCII character plus newline and tab, the
special tokens `<pad>`, `<unk>`, `<s>`, `</s>`, `<|im_start|>`, `<|im_end|>`, and a ChatML chat
template. It is a real `transformers.PreTrainedTokenizerFast`, so every code path that takes an
HF tokenizer (datasets, rollout, rewards) runs unchanged with tiny models.
Imports only `tokenizers` and `transformers` (CPU, no megatron / vLLM / Ray).
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


def build_tiny_tokenizer(save_dir: str | None = None):
    """Build the character-level tokenizer; `save_pretrained` it to `save_dir` when given.

    eos is `<|im_end|>` (the end of a chat turn, so generation stops there), pad is `<pad>` (id 0),
    bos is `<s>` (never added automatically). `AutoTokenizer.from_pretrained(save_dir)` loads it.
    """
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
    tokenizer.chat_template = CHATML_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer
