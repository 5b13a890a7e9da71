"""Block pool and KV cache manager: allocation, refcounts, prefix hits, LRU eviction, CoW, swap, no leaks."""

from __future__ import annotations

import pytest

from servelm.engine.block_pool import BlockPool, hash_block
from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.sequence import Request, Sequence
from servelm.sampling_params import SamplingParams


def make_seq(tokens: list[int], n: int = 1, salt: str | None = None) -> Sequence:
    req = Request("r", list(tokens), SamplingParams(n=n), cache_salt=salt)
    return Sequence(req, 0, list(tokens))


def computed(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> Sequence:
    """A sequence whose tokens are all computed and whose full blocks are in the prefix cache, then freed."""
    s = make_seq(tokens, salt=salt)
    assert kv.allocate(s, len(tokens))
    s.num_computed_tokens = len(tokens)
    kv.commit_computed(s)
    kv.free(s)
    return s


def test_alloc_free_refcounts():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(), pool.allocate()
    assert a != b and pool.num_free == 2 and pool.ref_counts[a] == 1
    pool.take(a)
    assert pool.ref_counts[a] == 2
    pool.release(a)
    assert pool.num_free == 2  # still referenced once
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_exhausted_pool_raises():
    pool = BlockPool(1, enable_caching=False)
    pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_hash_chain_depends_on_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [9, 9]), [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert len(hash_block(None, [1, 2])) == 32  # SHA-256, not a 64-bit hash() anyone can collide


def test_different_cache_salts_never_share_blocks():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    tokens = list(range(13))
    first = computed(kv, tokens, salt="tenant-a")
    assert len(kv.find_cached_prefix(make_seq(tokens, salt="tenant-a")).blocks) == 3  # same salt: shared
    for other in ("tenant-b", None):
        assert not kv.find_cached_prefix(make_seq(tokens, salt=other))
    # and an unsalted prompt's blocks are not found by a salted one either
    computed(kv, list(range(100, 113)))
    assert not kv.find_cached_prefix(make_seq(list(range(100, 113)), salt="tenant-a"))
    assert len(kv.find_cached_prefix(make_seq(list(range(100, 113)))).blocks) == 3
    assert first.block_hashes != make_seq(tokens).block_hashes


def test_forced_hash_collision_is_not_served(monkeypatch):
    """Every block key the same: a lookup must still only return a block holding exactly these tokens."""
    import servelm.engine.kv_cache_manager as kvm

    monkeypatch.setattr(kvm, "block_key", lambda preimage: b"\0" * 32)
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    computed(kv, [5, 6, 7, 8, 9])
    assert not kv.find_cached_prefix(make_seq([1, 2, 3, 4, 9]))  # same key, other tokens: a miss
    assert not kv.find_cached_prefix(make_seq([5, 6, 7, 8, 9], salt="other"))  # same key, other salt
    assert len(kv.find_cached_prefix(make_seq([5, 6, 7, 8, 1])).blocks) == 1  # the true owner still hits


def test_lru_eviction_order():
    pool = BlockPool(3, enable_caching=True)
    blocks = [pool.allocate() for _ in range(3)]
    for i, b in enumerate(blocks):
        pool.cache(b, 100 + i)
    for b in (blocks[1], blocks[0], blocks[2]):  # freed in this order
        pool.release(b)
    assert pool.allocate() == blocks[1]  # least recently freed goes first
    assert pool.lookup(101) is None and pool.num_evictions == 1
    assert pool.lookup(100) == blocks[0] and pool.lookup(102) == blocks[2]


def test_a_reset_forgets_the_prefixes_of_held_blocks_only_when_asked():
    """A weight update under held requests: their blocks stay theirs, no later request matches them, and once
    released they are plain free blocks."""
    pool = BlockPool(4, enable_caching=True)
    held, free = pool.allocate(), pool.allocate()
    pool.cache(held, 100)
    pool.cache(free, 101)
    pool.release(free)
    pool.reset_prefix_cache()
    assert pool.lookup(101) is None and pool.lookup(100) == held  # the held block keeps its prefix
    pool.reset_prefix_cache(in_use=True)
    assert pool.lookup(100) is None and pool.ref_counts[held] == 1
    pool.release(held)
    assert held in pool.free_plain and held not in pool.free_cached


def test_prefix_hit_takes_cached_block_out_of_free_queue():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    a = make_seq(list(range(10)))
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.commit_computed(a)  # two full blocks registered
    kv.free(a)
    b = make_seq(list(range(8)) + [50, 51, 52])
    hit = kv.find_cached_prefix(b)
    assert len(hit.blocks) == 2 and hit.partial is None  # [8, 9] were cached, not [50, 51]
    free_before = kv.num_free_blocks
    assert kv.allocate(b, 3, hit)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == hit.blocks
    assert kv.num_free_blocks == free_before - 3  # two cached blocks taken back + one new
    assert all(kv.pool.ref_counts[x] == 1 for x in hit.blocks)


def test_full_prompt_hit_still_leaves_a_token_to_compute():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    a = make_seq(list(range(8)))
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.commit_computed(a)
    kv.free(a)
    again = make_seq(list(range(8)))
    assert len(kv.find_cached_prefix(again).blocks) == 1  # the last block is recomputed for its logits


def test_a_partly_filled_block_is_copied_for_a_prompt_that_goes_on_from_it():
    """A finished sequence's partly filled last block is cached; a prompt that continues its tokens takes the
    full blocks and a copy of the partial one (the copy queued for the runner, its source held until the step
    ends), and computes only the rest. Generated tokens, other tokens or another salt miss it."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    computed(kv, list(range(10)))  # blocks [0-3] [4-7] and [8, 9] in a partly filled one
    child = make_seq(list(range(10)) + [77])  # beam search's next step: the parent's prompt and one token
    hit = kv.find_cached_prefix(child)
    assert len(hit.blocks) == 2 and hit.partial_tokens == 2 and hit.num_tokens == 10
    assert kv.allocate(child, 1, hit)
    assert child.num_computed_tokens == 10 and len(child.block_table) == 3
    ops = kv.take_ops()
    assert ops.copy == [(hit.partial, child.block_table[2])] and hit.partial != child.block_table[2]
    assert kv.pool.ref_counts[hit.partial] == 1  # held until the copy has run
    kv.end_step()
    assert kv.pool.ref_counts[hit.partial] == 0  # free again, still cached
    # the cached slots serve a prompt that holds all of them: [8] alone is another key
    assert kv.find_cached_prefix(make_seq(list(range(9)) + [5, 6])).partial is None
    assert not kv.find_cached_prefix(make_seq(list(range(10)) + [77], salt="other"))
    assert kv.find_cached_prefix(make_seq(list(range(8)) + [9, 8, 1])).partial is None
    # a block holding generated tokens serves only its own sample, resuming after preemption by recompute: a
    # prompt that holds the same tokens misses it, and a finished sample does not cache it at all
    kv2 = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    gen = make_seq(list(range(9)))  # a 9-token prompt that then generated token 9, then 10
    assert kv2.allocate(gen, 11)
    gen.token_ids += [9, 10]
    gen.num_computed_tokens = 10
    kv2.commit_computed(gen)
    kv2.reset_for_recompute(gen)
    assert kv2.find_cached_prefix(gen).num_tokens == 10  # [8, 9] copied, token 10 computed
    hit = kv2.find_cached_prefix(make_seq(list(range(10)) + [77]))
    assert len(hit.blocks) == 2 and hit.partial is None
    kv3 = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    done = make_seq(list(range(9)))
    assert kv3.allocate(done, 10)
    done.token_ids.append(9)
    done.num_computed_tokens = 10
    kv3.free(done)
    assert not kv3.pool.cached


def test_a_shared_partly_filled_block_is_not_cached_by_one_of_its_holders():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    parent = make_seq(list(range(6)), n=2)
    assert kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    kv.commit_computed(parent)
    child = Sequence(parent.request, 1, list(parent.token_ids))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    kv.free(parent)  # the fork still holds [4, 5]'s block and fills it on: not cached as partial
    assert kv.find_cached_prefix(make_seq(list(range(6)) + [1])).partial is None
    kv.free(child)
    assert kv.find_cached_prefix(make_seq(list(range(6)) + [1])).partial_tokens == 2


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(2, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    s = make_seq(list(range(12)))
    assert not kv.allocate(s, 12)
    assert s.block_table == [] and kv.num_free_blocks == 2


def test_copy_on_write_of_shared_partial_block():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=0)
    parent = make_seq(list(range(6)), n=2)
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    kv.commit_computed(parent)
    child = Sequence(parent.request, 1, list(parent.token_ids))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    shared_last = parent.block_table[1]
    assert kv.pool.ref_counts[shared_last] == 2
    parent.token_ids.append(7)
    assert kv.allocate(parent, 1)  # writes slot 6, inside the shared block: copy first
    ops = kv.take_ops()
    assert ops.copy == [(shared_last, parent.block_table[1])]
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    assert kv.pool.ref_counts[shared_last] == 1
    child.token_ids.append(8)
    assert kv.allocate(child, 1)
    assert not kv.take_ops().copy  # the last holder writes in place
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_swap_out_and_in_moves_blocks_to_cpu_and_back():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False, num_cpu_blocks=4)
    s = make_seq(list(range(7)))
    kv.allocate(s, 7)
    s.num_computed_tokens = 7
    dev = list(s.block_table)
    assert kv.can_swap_out(s)
    kv.swap_out(s)
    assert kv.num_free_blocks == 4 and len(s.cpu_block_table) == 2
    out_ops = kv.take_ops().swap_out
    assert [d for d, _ in out_ops] == dev
    s.token_ids.append(1)
    assert kv.swap_in(s, 1)
    in_ops = kv.take_ops().swap_in
    assert [c for c, _ in in_ops] == [c for _, c in out_ops]
    kv.end_step()
    assert len(kv.cpu_free) == 4  # cpu blocks return once the step's copies are done
    kv.free(s)
    assert kv.num_free_blocks == 4


def test_freed_blocks_are_reused_before_untouched_ones():
    # the pool's memory is mapped on first write: reusing warm blocks keeps a long run's RSS at its peak use
    pool = BlockPool(64, enable_caching=False)
    first = [pool.allocate() for _ in range(4)]
    for b in first:
        pool.release(b)
    again = [pool.allocate() for _ in range(4)]
    assert sorted(again) == sorted(first)


def test_plain_free_blocks_go_before_cached_prefixes():
    pool = BlockPool(3, enable_caching=True)
    cached, plain = pool.allocate(), pool.allocate()
    pool.cache(cached, 7)
    pool.release(cached)
    pool.release(plain)
    assert {pool.allocate(), pool.allocate()} == {plain, 2}  # the cached prefix survives
    assert pool.lookup(7) == cached and pool.num_evictions == 0
    assert pool.allocate() == cached and pool.lookup(7) is None and pool.num_evictions == 1


def _pool_state(pool: BlockPool) -> tuple:
    return (list(pool.ref_counts), list(pool.block_hash), list(pool.free_plain), list(pool.free_cached),
            dict(pool.cached), pool.num_evictions)


def test_many_at_once_is_the_same_as_one_by_one():
    """allocate_many / release_many (a prompt's blocks in one call) leave the pool exactly as single calls do:
    the same blocks in the same order, the same evictions, the same free queues."""
    import random

    rng = random.Random(0)
    pools = [BlockPool(24, enable_caching=True) for _ in range(2)]
    held: list[list[int]] = [[], []]
    for step in range(300):
        n = rng.randint(1, 6)
        if rng.random() < 0.55 and pools[0].num_free >= n:
            got = [[pools[0].allocate() for _ in range(n)], pools[1].allocate_many(n)]
            assert got[0] == got[1]
            for h in held:
                h.extend(got[0])
        elif held[0]:
            drop = held[0][-n:]
            for b in drop:
                pools[0].release(b)
            pools[1].release_many(drop)
            for h in held:
                del h[-len(drop):]
        for b in held[0][-2:]:  # some become cached prefixes (each under a key of its own), freed later
            if rng.random() < 0.5:
                for p in pools:
                    p.cache(b, bytes([step % 256, b]) * 16)
        assert _pool_state(pools[0]) == _pool_state(pools[1])
    assert pools[0].num_evictions > 0  # allocation did evict cached prefixes
    with pytest.raises(RuntimeError):
        pools[1].allocate_many(pools[1].num_free + 1)
