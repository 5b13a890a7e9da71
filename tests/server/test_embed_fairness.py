"""The embedding batcher's scheduling, with a fake encoder in place of the embedding process: a small request
is served between a large request's batches, results keep their order, a client that leaves frees its place."""

from __future__ import annotations

import asyncio
from pathlib import Path

from servelm.runtimes.embedder import Embedder


class FakeEmbedder(Embedder):
    """No process; each batch is recorded, and the first one is held until the test releases it."""

    def __init__(self, max_batch_size: int) -> None:
        super().__init__(Path("unused"), max_batch_size, batch_window_ms=0)
        self.batches: list[list[str]] = []
        self.first_started = asyncio.Event()
        self.release = asyncio.Event()

    def _start(self):
        return None, None

    async def _run(self, items: list):
        texts = [item[0] for item in items]  # (text, pair, cap, side): the text
        self.batches.append(texts)
        self.first_started.set()
        await self.release.wait()
        await asyncio.sleep(0)  # a real batch is awaited in another process: others run meanwhile
        return [f"vec:{t}" for t in texts], [len(t) for t in texts]


def test_small_request_finishes_between_a_large_requests_batches():
    async def main():
        emb = FakeEmbedder(max_batch_size=4)
        large_texts = [f"large-{i}" for i in range(40)]  # 10 batches
        finished: list[str] = []

        async def request(name: str, texts: list[str]):
            out = await emb.embed(texts)
            finished.append(name)
            return out

        large = asyncio.create_task(request("large", large_texts))
        await emb.first_started.wait()  # the large request's first batch is being encoded
        small = asyncio.create_task(request("small", ["small"]))
        await asyncio.sleep(0)  # let the small request enqueue
        emb.release.set()
        await asyncio.gather(large, small)
        assert finished == ["small", "large"], "the small request waited for the whole large one"
        assert any("small" in b for b in emb.batches[:2])  # it rode in the batch right after the first
        vecs, tokens = await small
        assert vecs == ["vec:small"] and tokens == 5
        vecs, tokens = await large
        assert vecs == [f"vec:{t}" for t in large_texts]  # every text's vector in its place
        assert tokens == sum(len(t) for t in large_texts)
        assert sorted(t for b in emb.batches for t in b) == sorted(large_texts + ["small"])  # each text once
        assert all(len(b) <= 4 for b in emb.batches)

    asyncio.run(main())


def test_a_client_that_leaves_takes_its_remaining_texts_out():
    async def main():
        emb = FakeEmbedder(max_batch_size=2)
        gone = asyncio.create_task(emb.embed([f"gone-{i}" for i in range(20)]))
        await emb.first_started.wait()
        gone.cancel()
        stays = asyncio.create_task(emb.embed(["stays"]))
        await asyncio.sleep(0)
        emb.release.set()
        assert (await stays)[0] == ["vec:stays"]
        assert sum(t.startswith("gone") for b in emb.batches for t in b) == 2  # only the batch already running

    asyncio.run(main())


def test_a_requests_batches_hold_texts_of_similar_length():
    """A batch is padded to its longest text: a request's texts go out shortest first, so each batch holds
    neighbours in length, and the answers still come back in the request's order."""
    async def main():
        emb = FakeEmbedder(max_batch_size=3)
        emb.release.set()
        texts = ["x" * n for n in (50, 1, 40, 2, 60, 3, 45, 55, 4)]
        vecs, _ = await emb.embed(texts)
        assert vecs == [f"vec:{t}" for t in texts]
        assert [sorted(len(t) for t in b) for b in emb.batches] == [[1, 2, 3], [4, 40, 45], [50, 55, 60]]
        pairs = [("q" * n, "d" * (40 - 2 * n)) for n in (3, 10, 1)]  # a cross-encoder's pairs: by both texts
        await emb._submit([(q, d, None, "right") for q, d in pairs])
        assert [len(q) for q in emb.batches[-1]] == [10, 3, 1]  # 30, 37 and 39 characters

    asyncio.run(main())


def test_an_input_that_failed_alone_fails_only_its_request():
    """The embedding process marks an input it could not run (the rest of its batch ran): that request fails,
    the others sharing its batch get their answers."""
    from servelm.runtimes.embedder import EncodeFailed

    class Flaky(FakeEmbedder):
        async def _run(self, items):
            texts = [item[0] for item in items]
            self.batches.append(texts)
            return [EncodeFailed("no") if t == "bad" else f"vec:{t}" for t in texts], [len(t) for t in texts]

    async def main():
        emb = Flaky(max_batch_size=8)
        good, bad = await asyncio.gather(emb.embed(["a", "b"]), emb.embed(["bad", "c"]), return_exceptions=True)
        assert good == (["vec:a", "vec:b"], 2) and isinstance(bad, EncodeFailed)
        assert len(emb.batches) == 1  # they shared one batch
        assert await emb.embed(["d"]) == (["vec:d"], 1)  # the batcher goes on

    asyncio.run(main())
