"""A prompt's token ids as both ends of a partial hand-off see them (docs/ARCHITECTURE.md §2, "Context
cache").

A decode node keeps the attention rows of a finished request (its context cache,
``nexrt_vllm.node.context_cache``). At ``begin`` (protocol version 2) the sender gives the prompt's
token ids, packed by ``pack_ids``; the node answers in ``accept`` how many leading tokens it already
holds (``held_tokens``) and the sender ships only the attention pages from there on. The rules both
ends follow are here, once:

* the ids travel as little-endian uint32 (``pack_ids`` / ``unpack_ids``): exact, so a node never
  serves rows of other tokens, whatever its index says;
* ``held_tokens`` is a whole number of the layout's pages (``block_size`` tokens) and at most the
  prompt: pages travel whole;
* the node indexes what it holds by chained block hashes, as vLLM's prefix cache keys its blocks:
  block i's key hashes block i-1's key with block i's ids, so one key names the whole prefix up to
  its block; the chain's root is the layout's salt (``layout_salt``), so rows received under
  another layout (block size, dtypes, model) never match.

Pure Python, like the rest of ``nexrt_vllm.handoff``.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Iterable, Iterator

import msgpack

ID_BYTES = 4  # bytes per token id on the wire
HASH_BYTES = 16  # bytes of a block key


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids -> the wire form: little-endian uint32, ``ID_BYTES`` per id."""
    a = array("I", ids)
    if a.itemsize != ID_BYTES:  # no platform we run on; the wire form must not depend on it
        raise RuntimeError(f"array('I') holds {a.itemsize} bytes per item, the wire form {ID_BYTES}")
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    """The wire form -> token ids (ValueError for a length that is not whole ids)."""
    if len(data) % ID_BYTES:
        raise ValueError(f"{len(data)} bytes are not whole {ID_BYTES}-byte token ids")
    a = array("I")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def num_ids(data: bytes) -> int:
    return len(data) // ID_BYTES


def layout_salt(layout_wire: dict) -> bytes:
    """The root of a layout's hash chain: a digest of its wire form (what rows were received under)."""
    return hashlib.blake2b(msgpack.packb(layout_wire, use_bin_type=True), digest_size=HASH_BYTES).digest()


def block_hashes(packed: bytes, block_size: int, salt: bytes) -> Iterator[bytes]:
    """The chained keys of the whole ``block_size``-token blocks of ``packed`` ids, lazily, in order."""
    step = block_size * ID_BYTES
    key = salt
    for off in range(0, len(packed) - step + 1, step):
        key = hashlib.blake2b(key + packed[off: off + step], digest_size=HASH_BYTES).digest()
        yield key


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading token ids two packed id strings share (binary search over slice compares)."""
    n = min(len(a), len(b)) // ID_BYTES
    if a[: n * ID_BYTES] == b[: n * ID_BYTES]:
        return n
    lo, hi = 0, n  # ids [0, lo) equal; [0, hi) not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * ID_BYTES: mid * ID_BYTES] == b[lo * ID_BYTES: mid * ID_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


def held_tokens(common: int, seq_len: int, block_size: int) -> int:
    """Leading tokens a node may skip: the ``common`` tokens it holds, capped at the prompt, in whole pages."""
    return (max(0, min(common, seq_len)) // block_size) * block_size


__all__ = ["ID_BYTES", "HASH_BYTES", "pack_ids", "unpack_ids", "num_ids", "layout_salt", "block_hashes",
           "common_prefix", "held_tokens"]
