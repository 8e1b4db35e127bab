"""A chat request's messages as the chat template reads them: text content only (a string, or
its text parts joined), `name` kept where given; other content parts are refused by name."""

from __future__ import annotations

from specdec.server.errors import APIError
from specdec.server.protocol import ChatMessage


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template sees them (text content; `name` when given).

    Raises:
        APIError: 400 for a content part other than text (this server's models read text only).
    """
    out = []
    for index, m in enumerate(messages):
        message = {"role": m.role, "content": _message_text(m.content, index)}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _message_text(content: str | list[dict] | None, index: int) -> str:
    """The text of message `index`'s content: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type")
        if kind != "text":
            raise APIError(
                400,
                f"this model takes text only: messages[{index}] has a content part of type "
                f"{kind!r} (send {{'type': 'text', 'text': ...}} parts or a string)",
                param="messages",
            )
        if not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"messages[{index}] has a text content part without a string 'text'",
                param="messages",
            )
        parts.append(part["text"])
    return "".join(parts)
