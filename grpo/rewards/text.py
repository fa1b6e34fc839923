"""Completion text: what a reward function scores, from a string or chat messages.

Pure Python; imports nothing of the project's.
"""


from collections.abc import Mapping
from typing import Any


def _content_text(content: Any) -> str:
    """Message content as text; multimodal part lists keep their text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


def completion_text(completion: Any) -> str:
    """The text to score: a string as is, or the last assistant message's content."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):  # a single message
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, Mapping)]
        for message in reversed(messages):
            if message.get("role") == "assistant":
                return _content_text(message.get("content"))
        # No role information: the last message is the model's turn.
        return _content_text(messages[-1].get("content")) if messages else ""
    return str(completion)
