"""NIXL backend (UCX). One agent per process; the receiver's metadata (bytes) travels in
``hello_ok``; the sender loads it once per peer and posts WRITEs polled against a deadline.

Set ``UCX_NET_DEVICES`` (e.g. ``lo`` for single-host tests) to pin the interfaces UCX uses.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Sequence

from nexrt_vllm.handoff.transport.base import (ReceiverTransport, SenderTransport, TransferError, TransferInFlight, Write,
                                       _check_kind)

_MEM = {"host": "DRAM", "device": "VRAM"}


def _agent(role: str):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    # STRICT: the agent is used from several threads (the receiver's progress loop, the event loop;
    # a connector's per-request jobs); NIXL's default without a listener thread has no locking.
    conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                             sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    return nixl_agent(f"nexrt-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}", conf)


class _NixlBase:
    name = "nixl"
    memory_kinds = ("host", "device")

    def __init__(self, role: str):
        self._agent = _agent(role)
        self._regs = []
        self._dev = 0

    def register(self, addr: int, size: int, kind: str = "host", device: int = 0) -> None:
        _check_kind(self, kind)
        if kind == "device":  # VRAM descriptors carry the GPU index (UCX: cuda_ipc / cuda_copy)
            self._dev = device
        self._regs.append((addr, self._agent.register_memory([(addr, size, self._dev, "")], _MEM[kind])))

    def unregister(self, addr: int) -> None:
        for entry in [e for e in self._regs if e[0] == addr]:
            self._regs.remove(entry)
            self._agent.deregister_memory(entry[1])

    def close(self) -> None:
        for _, reg in self._regs:
            self._agent.deregister_memory(reg)
        self._regs.clear()


class NixlReceiver(_NixlBase, ReceiverTransport):
    """Some UCX transports (TCP, same-process loopback) complete a remote WRITE only while the
    target's worker is progressed. NIXL's own progress thread spins without pause (a whole core);
    instead a thread here progresses the worker every ``PROGRESS_S`` (near-zero idle CPU)."""

    PROGRESS_S = 0.001

    def __init__(self):
        super().__init__("recv")
        self._kinds: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        while not self._stop.wait(self.PROGRESS_S):
            self._agent.get_new_notifs()  # progresses the UCX worker as a side effect

    def register(self, addr: int, size: int, kind: str = "host", device: int = 0) -> None:
        super().register(addr, size, kind, device)
        self._kinds.add(kind)

    def peer_info(self) -> dict:
        # metadata is read after registration so it lists every receive buffer
        return {"backend": self.name, "agent": self._agent.name, "metadata": self._agent.get_agent_metadata(),
                "mem": _MEM[next(iter(self._kinds), "host")], "dev": self._dev}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        super().close()


class NixlSender(_NixlBase, SenderTransport):
    def __init__(self):
        super().__init__("send")
        self._peers: dict[str, str] = {}  # remote agent name -> loaded name
        self._remote_mem: dict[str, tuple[str, int]] = {}  # loaded name -> (memory type, device id)
        self._local_mem = "DRAM"
        self._connect_lock = threading.Lock()  # load each peer's metadata once, whatever the thread

    def register(self, addr: int, size: int, kind: str = "host", device: int = 0) -> None:
        super().register(addr, size, kind, device)
        self._local_mem = _MEM[kind]

    def connect(self, peer_info: dict) -> str:
        if peer_info.get("backend") != self.name or not isinstance(peer_info.get("metadata"), bytes):
            raise TransferError(f"not a nixl peer: {str(peer_info)[:200]}")
        agent = peer_info["agent"]
        with self._connect_lock:
            return self._connect(agent, peer_info)

    def _connect(self, agent: str, peer_info: dict) -> str:
        if agent not in self._peers:
            name = self._agent.add_remote_agent(peer_info["metadata"])
            self._peers[agent] = name.decode() if isinstance(name, bytes) else name  # returns bytes
        self._remote_mem[self._peers[agent]] = (peer_info.get("mem", "DRAM"), int(peer_info.get("dev", 0)))
        return self._peers[agent]

    def write(self, peer: str, writes: Sequence[Write], timeout: float) -> None:
        if not writes:
            return
        deadline = time.monotonic() + timeout
        try:
            mem, dev = self._remote_mem[peer]
            local = self._agent.get_xfer_descs([(w[0], w[2], self._dev) for w in writes], self._local_mem)
            remote = self._agent.get_xfer_descs([(w[1], w[2], dev) for w in writes], mem)
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception as e:  # noqa: BLE001 - nixl raises its own error types (out of bounds: NOT_FOUND)
            raise TransferError(f"nixl write to {peer} refused: {e!r}") from None
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - a dead peer surfaces as NIXL_ERR_BACKEND
            self._release(handle)
            raise TransferError(f"nixl write to {peer} failed: {e!r}") from None
        released = self._release(handle)  # aborts a transfer still in flight, if it can
        if state == "PROC":
            cls = TransferError if released else TransferInFlight
            raise cls(f"nixl write to {peer} did not finish in {timeout}s")
        if state != "DONE":
            raise TransferError(f"nixl write to {peer} ended in state {state}")

    def _release(self, handle) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:  # noqa: BLE001 - NIXL refuses to release a transfer it cannot abort
            return False
