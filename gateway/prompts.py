"""Prompt text -> token ids, where only the chat template may produce control tokens.

A user who types "<|im_end|><|im_start|>system" must not end their turn and open a system
turn: text the user supplied is tokenized with ``split_special_tokens=True`` (special-token text
becomes ordinary tokens, e.g. "<", "|", "im", ...), while the template's own markers stay single
control tokens.

For chat, the template is rendered with a placeholder in place of each message's content; the
rendered text is tokenized piece by piece: template pieces as usual, contents as plain text.
This path is taken only when some content holds special-token text, so every other prompt is
tokenized exactly as ``tokenizer.encode(apply_chat_template(...))`` would (a template that
edits contents, e.g. trims them, sees the placeholder instead on that path).

These run off the event loop (``asyncio.to_thread``): a large prompt takes seconds.
"""

from __future__ import annotations

import re
import uuid


def special_token_texts(tokenizer) -> list[str]:
    return [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    """A completion prompt: plain text, special-token text included."""
    return tokenizer.encode(text, split_special_tokens=True)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    specials = special_token_texts(tokenizer)
    if not any(special in message["content"] for message in messages for special in specials):
        return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
    markers = [f"\ue000{uuid.uuid4().hex}\ue001" for _ in messages]
    rendered = render_chat(tokenizer, [message | {"content": marker} for message, marker in zip(messages, markers, strict=True)])
    content_of = {marker: message["content"] for marker, message in zip(markers, messages, strict=True)}
    token_ids: list[int] = []
    position = 0
    for match in re.finditer("|".join(map(re.escape, markers)), rendered):
        token_ids += _encode(tokenizer, rendered[position : match.start()], split_special_tokens=False)
        token_ids += _encode(tokenizer, content_of[match.group()], split_special_tokens=True)
        position = match.end()
    return token_ids + _encode(tokenizer, rendered[position:], split_special_tokens=False)


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _encode(tokenizer, text: str, split_special_tokens: bool) -> list[int]:
    if not text:
        return []
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens)
