"""The start of a request's prompt, read from its parsed body for the engine-affinity hash
(:func:`proxy.routing.placement.affinity_key`): one reader for every kind of request (chat,
completions, Responses, LightLLM's native routes).
"""

from __future__ import annotations


def prompt_prefix(fields: dict, chars: int) -> str | None:
    """The first ``chars`` characters of a request's prompt, for the affinity hash
    (:func:`proxy.routing.placement.affinity_key`), or ``None`` when it has no text prompt.

    Chat: each message as ``role: text`` on its own line (a shared system prompt makes a
    shared prefix); completions: ``prompt`` (the first one of a list); Responses:
    ``instructions``, then ``input`` (a string, or its items' text); LightLLM native:
    ``inputs``. Reads only as much of the body as needed.
    """
    if chars <= 0:
        return None
    parts: list[str] = []
    have = 0

    def add(text: str) -> bool:
        nonlocal have
        parts.append(text[: chars - have])
        have += len(parts[-1])
        return have >= chars

    msgs = fields.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if isinstance(m, dict) and add(f"{m.get('role')}: {_message_text(m.get('content'))}\n"):
                break
    elif isinstance(fields.get("prompt"), (str, list)):
        p = fields["prompt"]
        first = p if isinstance(p, str) else (p[0] if p and isinstance(p[0], str) else "")
        add(first)
    elif "input" in fields or "instructions" in fields:
        full = isinstance(fields.get("instructions"), str) and add(fields["instructions"] + "\n")
        inp = fields.get("input")
        if full:
            pass
        elif isinstance(inp, str):
            add(inp)
        elif isinstance(inp, list):
            for item in inp:
                if isinstance(item, dict) and add(f"{item.get('role')}: {_message_text(item.get('content'))}\n"):
                    break
    elif isinstance(fields.get("inputs"), str):
        add(fields["inputs"])
    text = "".join(parts)
    return text or None


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
