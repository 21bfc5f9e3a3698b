"""The router's node pool with nodes of several slots (`/capabilities` max_batch): up to that many
requests in flight per node, the least-loaded node first, FIFO waiters served as slots free up,
warm-ups only on idle nodes, Retry-After from the tier's capacity."""
import asyncio

import pytest

from nexrt_vllm.router.pool import NodePool, QueueFull


def _pool(*caps, queue_size=4):
    pool = NodePool([f"http://n{i}" for i in range(len(caps))], queue_size=queue_size, queue_timeout=5)
    for node, c in zip(pool.nodes, caps):
        pool.mark_up(node, {} if c is None else {"max_batch": c})
    return pool


def test_capacity_comes_from_capabilities():
    a, b, c, d = _pool(4, None, 0, True).nodes
    assert (a.capacity, b.capacity, c.capacity, d.capacity) == (4, 1, 1, 1)  # bad values count as 1


def test_least_loaded_first_up_to_capacity():
    pool = _pool(3, 1)
    a, b = pool.nodes
    got = [pool.try_acquire() for _ in range(4)]
    # both idle: round-robin picks a; then b (0 in flight) before a's second slot; then a, a
    assert got == [a, b, a, a] and (a.in_flight, b.in_flight) == (3, 1)
    assert a.busy and b.busy and pool.try_acquire() is None and pool.busy_count == 4
    pool.release(a)
    assert pool.try_acquire() is a
    for n in (a, a, a, b):
        pool.release(n)
    assert pool.busy_count == 0
    with pytest.raises(AssertionError, match="double release"):
        pool.release(b)


def test_waiters_get_slots_in_order():
    async def run():
        pool = _pool(2, queue_size=2)
        (a,) = pool.nodes
        assert await pool.acquire() is a and await pool.acquire() is a
        w1, w2 = asyncio.ensure_future(pool.acquire()), asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await pool.acquire()
        pool.release(a)
        assert await w1 is a and not w2.done()
        pool.release(a)
        assert await w2 is a and a.in_flight == 2
    asyncio.run(run())


def test_warm_up_takes_only_an_idle_node():
    pool = _pool(4)
    (a,) = pool.nodes
    assert pool.try_acquire() is a
    assert not pool.take(a)  # a request is there: it sets the path up itself
    pool.release(a)
    assert pool.take(a) and a.in_flight == 1
    pool.release(a)


def test_retry_after_counts_slots():
    pool = _pool(4, 1)
    a, b = pool.nodes
    for _ in range(3):
        pool.record_service_time(a, 2.0)
        pool.record_service_time(b, 2.0)
    # 4 / 2 s + 1 / 2 s = 2.5 requests per second
    assert pool.expected_wait(5) == pytest.approx(2.0)
