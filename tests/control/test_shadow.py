"""Shadow mirror (servelm/control/shadow.py): comparisons per pair, overflow counted and never blocking."""

import asyncio

import pytest

from servelm.control.shadow import ShadowMirror, ShadowResult, similarity


def test_similarity():
    assert similarity([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert similarity([], []) == 1.0
    assert similarity([1, 2, 3, 4], [5, 6]) == 0.0
    assert similarity([1, 2, 3, 4], [1, 2, 9, 4]) == pytest.approx(0.75)  # 2 * 3 matching / 8


def test_pairs_are_compared_and_shadow_errors_counted():
    async def run(req):
        if req == "boom":
            raise RuntimeError("shadow died")
        return ShadowResult(tokens=req, latency=0.3)

    async def main():
        m = ShadowMirror(run, maxsize=8)
        m.start()
        assert m.offer([1, 2, 3], ShadowResult(tokens=[1, 2, 3], latency=0.1))  # agrees
        assert m.offer([1, 2, 9], ShadowResult(tokens=[1, 2, 3], latency=0.2))  # differs in one token
        assert m.offer("boom", ShadowResult(tokens=[1], latency=0.1))
        await m.drain()
        await m.stop()
        return m.stats.summary()

    s = asyncio.run(main())
    assert (s["pairs"], s["compared"], s["shadow_errors"], s["dropped"]) == (3, 2, 1, 0)
    assert s["exact_agreement"] == 0.5
    assert s["similarity_mean"] == pytest.approx((1.0 + 2 * 2 / 6) / 2)
    assert s["latency_delta_p50"] == pytest.approx((0.2 + 0.1) / 2)


def test_overflow_drops_and_counts_without_blocking():
    release = None

    async def run(req):
        await release.wait()  # the shadow is stuck: the queue fills up
        return ShadowResult(tokens=[req])

    async def main():
        nonlocal release
        release = asyncio.Event()
        m = ShadowMirror(run, maxsize=4)
        m.start()
        await asyncio.sleep(0)  # let the worker take its first job once there is one
        accepted = [m.offer(i, ShadowResult(tokens=[i])) for i in range(20)]  # offer is synchronous
        release.set()
        await m.drain()
        await m.stop()
        return accepted, m.stats.summary()

    accepted, s = asyncio.run(main())
    assert accepted[:4] == [True] * 4 and not any(accepted[5:])
    assert s["dropped"] == accepted.count(False) and s["pairs"] == accepted.count(True)
    assert s["exact_agreement"] == 1.0
