"""The decode node's context cache: a finished request's attention rows, kept for the conversation's
next turn so that its hand-off ships only what the node lacks (docs/NODE.md, "Context cache").

An agent's next prompt is its last prompt, the answer and a little more. When a request ends, the node
keeps the K/V rows of every full-attention layer for the tokens it knows (the prompt's ids, given at
``begin``, then vLLM's first token and the tokens it decoded) in a bounded LRU (``--context-cache-gib``).
At the next ``begin`` it looks the new prompt up and answers ``held_tokens`` (``nexrt_vllm.handoff.prefix``):
the sender skips those pages and the node fills the rows from the cache before loading the received
tail. GDN conv and recurrent state are recurrent, the prompt's final state always travels (small and
fixed).

Never wrong rows: an entry is found by chained block keys rooted in the sender's layout, then the
prompt's ids are compared with the entry's, exactly; what does not match (another layout, another
prefix, a key collision) is not held and travels. An entry a hand-off is using is pinned until its
rows are in the engine (or the admission ended), so it cannot be evicted under it.

``NodeContext`` is what the service calls (begin, end of an admission, end of a request); ``Prefix``
rides on the hand-off's ``PartSet`` so that ``parts.load_parts`` fills the held rows.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass, field

import torch

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.prefix import (ID_BYTES, block_hashes, common_prefix, held_tokens, layout_salt, num_ids,
                                       pack_ids)

log = logging.getLogger("nexrt.node.context")


@dataclass(eq=False)
class Entry:
    """One kept context: the ids of its rows and, per attention layer, K and V ``[kv_heads, n, head_dim]``."""

    ids: bytes  # packed token ids, one per row
    salt: bytes  # the layout its prompt rows were received under (prefix.layout_salt)
    block_size: int
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]]
    keys: list[bytes]  # chained keys of its whole blocks
    nbytes: int
    pins: int = 0

    @property
    def tokens(self) -> int:
        return num_ids(self.ids)


@dataclass(eq=False)
class Hit:
    """A pinned entry and how many leading tokens of a prompt it holds."""

    cache: "ContextCache"
    eid: int
    entry: Entry
    tokens: int
    released: bool = False

    def fill(self, state) -> None:
        """Rows [0, tokens) of every attention layer of ``state`` (an engine's DecodeState) from the
        entry; the pin is released after."""
        try:
            for i, (k, v) in self.entry.rows.items():
                att = state.attention(i)
                att.k[:, : self.tokens].copy_(k[:, : self.tokens])
                att.v[:, : self.tokens].copy_(v[:, : self.tokens])
        finally:
            self.release()

    def release(self) -> None:
        self.cache.release(self)


class ContextCache:
    """Bounded LRU of entries; ``capacity`` bytes of rows (0: off). Thread-safe: lookups run on the
    node's event loop, stores and fills in its decode thread."""

    def __init__(self, capacity: int, metrics=None):
        self.capacity = max(0, int(capacity))
        self.metrics = metrics  # NodeMetrics (its context_* members) or None
        self.nbytes = 0  # rows held, plus those being stored
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # LRU first
        self._index: dict[bytes, dict[int, None]] = {}  # block key -> entries holding it, oldest first
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._gauges()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    # ---- lookup ----------------------------------------------------------------------------------
    def lookup(self, prompt: bytes, salt: bytes, block_size: int, seq_len: int) -> Hit | None:
        """The entry holding the most leading tokens of ``prompt`` (packed ids) under this layout,
        pinned, or None (nothing held)."""
        with self._lock:
            found = None
            for key in block_hashes(prompt[: seq_len * ID_BYTES], block_size, salt):
                holders = self._index.get(key)
                if not holders:
                    break
                found = holders
            hit = None
            if found is not None:
                eid = next(reversed(found))
                entry = self._entries[eid]
                held = held_tokens(common_prefix(entry.ids, prompt), seq_len, block_size)  # exact, keys aside
                if held:
                    entry.pins += 1
                    self._entries.move_to_end(eid)
                    hit = Hit(self, eid, entry, held)
        self.count("lookups", "hit" if hit else "miss")
        if hit is not None and self.metrics is not None:
            self.metrics.context_held_tokens.inc(hit.tokens)
        return hit

    def release(self, hit: Hit) -> None:
        with self._lock:
            if not hit.released:
                hit.released = True
                hit.entry.pins -= 1

    # ---- store -----------------------------------------------------------------------------------
    def store(self, ids: bytes, salt: bytes, block_size: int, state) -> bool:
        """Keep rows [0, n) of ``state``'s attention layers for the n packed ``ids`` (cut to what
        fits); entries the new one makes redundant go, then the least recently used ones. False
        when nothing was kept (too short, or pinned entries fill the cache)."""
        layers = state.config.attention_layers
        if not self.enabled or not layers:
            return False
        row = sum(2 * state.attention(i).k[:, :1].nbytes for i in layers)  # bytes of one token's rows
        n = min(num_ids(ids), state.seq_len, self.capacity // row)
        if n < block_size:
            return False
        ids, need = ids[: n * ID_BYTES], n * row
        with self._lock:
            for eid, e in list(self._entries.items()):
                if e.pins == 0 and e.salt == salt and e.block_size == block_size and \
                        common_prefix(e.ids, ids) >= e.tokens // block_size * block_size:
                    self._drop(eid, "superseded")
            for eid, e in list(self._entries.items()):
                if self.nbytes + need <= self.capacity:
                    break
                if e.pins == 0:
                    self._drop(eid, "evicted")
            if self.nbytes + need > self.capacity:
                self.count("stores", "no_room")
                return False
            self.nbytes += need  # reserved while the rows are copied outside the lock
        try:
            rows = {i: (state.attention(i).k[:, :n].clone(), state.attention(i).v[:, :n].clone()) for i in layers}
            keys = list(block_hashes(ids, block_size, salt))
        except BaseException:
            with self._lock:
                self.nbytes -= need
            raise
        with self._lock:
            eid = next(self._ids)
            self._entries[eid] = Entry(ids, salt, block_size, rows, keys, need)
            for key in keys:
                self._index.setdefault(key, {})[eid] = None
        self.count("stores", "kept")
        self._gauges()
        return True

    def _drop(self, eid: int, why: str) -> None:
        """Remove an unpinned entry (lock held)."""
        e = self._entries.pop(eid)
        for key in e.keys:
            holders = self._index.get(key)
            if holders is not None:
                holders.pop(eid, None)
                if not holders:
                    del self._index[key]
        self.nbytes -= e.nbytes
        if self.metrics is not None:
            self.metrics.context_dropped.labels(why).inc()

    def clear(self) -> None:
        with self._lock:
            for eid in [eid for eid, e in self._entries.items() if e.pins == 0]:
                self._drop(eid, "evicted")
        self._gauges()

    # ---- metrics ---------------------------------------------------------------------------------
    def count(self, what: str, outcome: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, f"context_{what}").labels(outcome).inc()
            self._gauges()

    def _gauges(self) -> None:
        m = self.metrics
        if m is not None:
            m.context_capacity.set(self.capacity)
            m.context_bytes.set(self.nbytes)
            m.context_entries.set(len(self._entries))


@dataclass(eq=False)
class Prefix:
    """What one hand-off's node knows of its prompt: the ids (None: not given, or unusable here),
    the layout it came under and the cached rows it starts from (``hit``; None: a full hand-off)."""

    prompt: bytes | None = None
    salt: bytes = b""
    block_size: int = 0
    hit: Hit | None = None

    @property
    def held(self) -> int:
        return self.hit.tokens if self.hit is not None else 0

    def fill(self, state) -> None:
        if self.hit is not None:
            self.hit.fill(state)

    def release(self) -> None:
        if self.hit is not None:
            self.hit.release()


@dataclass
class NodeContext:
    """The service's calls into the context cache: ``begin`` (lookup, when a hand-off begins),
    ``release`` (an admission ended: unpin), ``store`` (a request's decode ended: keep its rows)."""

    cache: ContextCache = field(default_factory=lambda: ContextCache(0))

    def begin(self, msg: P.Begin, layout: L.Layout, engine) -> Prefix:
        """The hand-off's Prefix: a lookup when the sender gave the prompt and the node can use it
        (an unsharded layout into a one-device engine), else a full hand-off."""
        if not self.cache.enabled:
            return Prefix()
        if msg.prompt is None or layout.sharding is not None or getattr(engine, "tp", 1) != 1:
            self.cache.count("lookups", "unusable")
            return Prefix()
        if len(msg.prompt) != msg.seq_len * ID_BYTES:
            log.warning("rid=%s: begin gives %d bytes of prompt ids for seq_len %d; full hand-off", msg.rid,
                        len(msg.prompt), msg.seq_len)
            self.cache.count("lookups", "unusable")
            return Prefix()
        salt = layout_salt(msg.layout)
        hit = self.cache.lookup(msg.prompt, salt, layout.block_size, msg.seq_len)
        return Prefix(msg.prompt, salt, layout.block_size, hit)

    @staticmethod
    def release(parts) -> None:
        """The admission ended (any outcome): its cached rows, if still pinned, are free to go."""
        if parts is not None:
            parts.prefix.release()

    def store(self, engine, parts, first_token: int, tokens: list[int]) -> None:
        """A request's decode ended without error: keep the rows of the tokens the node knows, the
        prompt, vLLM's first token and those decoded (``state.seq_len`` bounds them: the last token
        decoded is never fed)."""
        p = parts.prefix if parts is not None else None
        if p is None or p.prompt is None or not self.cache.enabled:
            return
        try:
            self.cache.store(p.prompt + pack_ids([first_token, *tokens]), p.salt, p.block_size, engine.state)
        except Exception:  # noqa: BLE001 - a cache failure must not fail the request that already streamed
            log.exception("context cache: storing the rows failed")


__all__ = ["ContextCache", "Entry", "Hit", "NodeContext", "Prefix"]
