"""Conversation affinity: a conversation's next turn goes to the decode node that served its last
one, when that node is free, since that node keeps the conversation's context (its context cache,
docs/NODE.md) and the hand-off then ships only what is new. Otherwise any free node takes it, with
the full hand-off.

The router sees text, not token ids, so a conversation is named by what the client says:

1. the `x-session-id` header;
2. else the OpenAI `user` field;
3. else, for chat, a digest of the leading messages up to and including the first user message
   (an agent's conversation keeps them across turns; conversations that share only a system prompt
   differ there).

A completion without a session id or `user` has no affinity (a raw prompt has no turn boundaries).
The map is bounded (least recently used names go first) and in memory: a router restart forgets it.
"""
from __future__ import annotations

import collections
import hashlib
import json

SESSION_HEADER = "x-session-id"
MAX_SESSIONS = 65536


def session_key(headers, body: dict, kind: str) -> str | None:
    """The conversation's name (header, `user`, leading chat messages) or None."""
    sid = headers.get(SESSION_HEADER)
    if sid:
        return "session:" + sid
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages = body.get("messages")
    if kind == "chat" and isinstance(messages, list):
        lead = []
        for m in messages:
            lead.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        else:
            return None  # no user message yet: nothing names the conversation
        text = json.dumps(lead, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "chat:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return None


class Affinity:
    """Conversation name -> the URL of the node that served its last turn."""

    def __init__(self, size: int = MAX_SESSIONS):
        self.size = size
        self._last: collections.OrderedDict[str, str] = collections.OrderedDict()

    def node_for(self, key: str | None) -> str | None:
        return self._last.get(key) if key is not None else None

    def served(self, key: str | None, url: str) -> None:
        """`url` served a turn of conversation `key` to its end: it holds its context now."""
        if key is None:
            return
        self._last[key] = url
        self._last.move_to_end(key)
        while len(self._last) > self.size:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
