"""Turning a prompt text into token ids, the one way the CLI and the benchmark both use."""

from __future__ import annotations

from typing import Any

__all__ = ["encode_prompt"]


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of one prompt, optionally wrapped as a user turn in the tokenizer's chat template.

    A chat template already contains its special tokens, so the templated text is tokenized
    without adding more (a second BOS would change the output).
    """
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])
