"""KV cache bookkeeping for sequences: block tables, prefix-cache hits, copy-on-write, swap to CPU.

The scheduler talks only to this class; the block pool stays hidden behind it. Physical copies it decides
on (CoW, swap out/in) are queued here and executed by the model runner before the next forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.engine.block_pool import BlockPool, block_key, block_preimage, partial_preimage, root_hash
from servelm.engine.sequence import Sequence


@dataclass
class BlockOps:
    """Physical block copies for the runner, in this order: swap out, swap in, copy-on-write."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src device block, dst device block)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy)


@dataclass
class CachedPrefix:
    """A sequence's prefix-cache hits: full blocks, then possibly a partly filled block whose first
    `partial_tokens` slots go on from them (copied into a block of the sequence's own at admission)."""

    blocks: list[int] = field(default_factory=list)
    partial: int | None = None
    partial_tokens: int = 0
    block_size: int = 16

    def __bool__(self) -> bool:
        return bool(self.blocks) or self.partial is not None

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.partial_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._cpu_release_after_step: list[int] = []
        self.ops = BlockOps()
        self._release_after_step: list[int] = []  # copy sources held until the copies have run
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.num_cow_copies = 0

    # -- admission ---------------------------------------------------------------------------------
    def _parent(self, seq: Sequence, i: int) -> bytes:
        return seq.block_hashes[i - 1] if i else root_hash(seq.request.cache_salt, seq.request.lora_key)

    def _num_prompt(self, seq: Sequence, i: int) -> int | None:
        """None where block i lies wholly in seq's prompt, else how many of its tokens do (see block_preimage)."""
        in_prompt = seq.num_prompt_tokens - i * self.block_size
        return None if in_prompt >= self.block_size else max(in_prompt, 0)

    def _content(self, seq: Sequence, i: int) -> bytes:
        """The preimage of block i's key: what a prefix-cache hit on it must match exactly."""
        bs = self.block_size
        return block_preimage(self._parent(seq, i), seq.token_ids[i * bs:(i + 1) * bs], self._num_prompt(seq, i))

    def _update_hashes(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend seq.block_hashes over every full block within the first `upto_tokens` tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), upto_tokens // bs):
            hashes.append(block_key(self._content(seq, i)))

    def _partial_content(self, seq: Sequence, i: int, m: int) -> bytes:
        """The preimage of the key of block i's first m slots (a partly filled block; see partial_preimage):
        marked, as a full block is, when some of them are not prompt tokens."""
        in_prompt = seq.num_prompt_tokens - i * self.block_size
        tokens = seq.token_ids[i * self.block_size:i * self.block_size + m]
        return partial_preimage(self._parent(seq, i), tokens, None if in_prompt >= m else max(in_prompt, 0))

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached prefix of seq (no side effects): full blocks, then the longest run of the next
        block's tokens that a cached partly filled block holds. At least one token is left to compute, because
        sampling needs the last position's logits."""
        found = CachedPrefix(block_size=self.block_size)
        if not self.pool.enable_caching:
            return found
        self._update_hashes(seq, seq.num_tokens - 1)
        for i, h in enumerate(seq.block_hashes):
            b = self.pool.lookup(h, self._content(seq, i))
            if b is None:
                break
            found.blocks.append(b)
        k = len(found.blocks)
        for m in range(min(self.block_size - 1, seq.num_tokens - 1 - k * self.block_size), 0, -1):
            content = self._partial_content(seq, k, m)
            b = self.pool.lookup(block_key(content), content)
            if b is not None:
                found.partial, found.partial_tokens = b, m
                break
        return found

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of seq; False (and no change) if blocks are short.

        `cached`, for a sequence being admitted, are prefix-cache hits: its full blocks become the sequence's
        first blocks, a partly filled one is copied into a block of its own.
        """
        bs = self.block_size
        if not cached:  # the common case, a running sequence's next tokens: often no new block at all
            computed, table = seq.num_computed_tokens, seq.block_table
            need = -(-(computed + num_new_tokens) // bs) - len(table)
            # _needs_cow, inlined: this runs for every running sequence at every step
            cow = computed % bs != 0 and self.pool.ref_counts[table[computed // bs]] > 1
            if need <= 0 and not cow:
                return True
            need = max(0, need)
            if need + int(cow) > self.pool.num_free:
                return False
            if cow:
                self._copy_on_write(seq)
            if need:
                table += self.pool.allocate_many(need)
            return True
        blocks, partial = cached.blocks, cached.partial
        num_computed = seq.num_computed_tokens + cached.num_tokens
        have = len(seq.block_table) + len(blocks)
        need = max(0, -(-(num_computed + num_new_tokens) // bs) - have)  # the partial hit's copy among them
        # the hits become an admitted sequence's first blocks: nothing of its own is shared, no copy-on-write
        held = blocks + ([partial] if partial is not None else [])
        if need + self.pool.num_taken_from_free(held) > self.pool.num_free:
            return False
        for b in held:
            self.pool.take(b)
        seq.block_table.extend(blocks)
        seq.num_computed_tokens = num_computed
        if need:
            seq.block_table += self.pool.allocate_many(need)
        if partial is not None:  # its slots into the sequence's block before the step runs; held until then
            self.ops.copy.append((partial, seq.block_table[len(blocks)]))
            self._release_after_step.append(partial)
        return True

    def append_blocks(self, seqs: list[Sequence]) -> list[int]:
        """One more block at the end of each of seqs' tables (the caller checked num_free_blocks), taken from
        the pool at once, in the order one call per sequence would take them; returns them."""
        blocks = self.pool.allocate_many(len(seqs))
        for seq, block in zip(seqs, blocks, strict=True):
            seq.block_table.append(block)
        return blocks

    def record_prefix_query(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += num_hit_tokens

    def _needs_cow(self, seq: Sequence) -> bool:
        """The next token lands in a partly filled block that another sequence also references."""
        if seq.num_computed_tokens % self.block_size == 0:
            return False
        last = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.pool.ref_counts[last] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        idx = seq.num_computed_tokens // self.block_size
        src = seq.block_table[idx]
        dst = self.pool.allocate()
        self.ops.copy.append((src, dst))
        self.num_cow_copies += 1
        self.pool.release(src)
        seq.block_table[idx] = dst

    def commit_computed(self, seq: Sequence) -> None:
        """After a forward pass: register the prompt's blocks that are now full in the prefix cache.

        A block holding generated tokens is keyed apart from any prompt's (see block_preimage): only the same
        history computed again, a sample resuming after preemption by recompute, can hit it. So it is registered
        then (reset_for_recompute), not each time a decode fills one, which was most of a decode step's upkeep.
        """
        self._register(seq, min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size)

    def _register(self, seq: Sequence, full: int) -> None:
        """Enter seq's first `full` blocks in the prefix cache (each block's preimage built once: it is both
        what its key hashes and what a hit must match)."""
        if not self.pool.enable_caching:
            return
        first, hashes = seq.num_registered_blocks, seq.block_hashes
        for i in range(first, full):
            content = self._content(seq, i)
            if i == len(hashes):
                hashes.append(block_key(content))
            self.pool.cache(seq.block_table[i], hashes[i], content)
        seq.num_registered_blocks = max(first, full)

    # -- sharing and release -----------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (copy-on-write protects the partly filled last one)."""
        for b in parent.block_table:
            self.pool.take(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def _register_partial(self, seq: Sequence) -> None:
        """Enter seq's partly filled last computed block in the prefix cache, as it lets it go: a sequence that
        goes on from the same tokens copies its slots. Only a block that seq alone holds and that has no key yet
        (one shared with a fork keeps filling up for the fork, and is registered whole when full)."""
        if not self.pool.enable_caching or not seq.block_table:
            return
        bs = self.block_size
        i, m = divmod(seq.num_computed_tokens, bs)
        if not m or i >= len(seq.block_table):
            return
        block = seq.block_table[i]
        if self.pool.ref_counts[block] != 1 or self.pool.block_hash[block] is not None:
            return
        self._update_hashes(seq, i * bs)
        content = self._partial_content(seq, i, m)
        self.pool.cache(block, block_key(content), content)

    def free(self, seq: Sequence) -> None:
        # A finished prompt-only block can serve a longer prompt (beam search's next step); one holding
        # generated tokens only the same sample recomputed, which reset_for_recompute registers.
        if seq.num_computed_tokens <= seq.num_prompt_tokens:
            self._register_partial(seq)
        # Tail first, so that the blocks least likely to be shared are evicted first.
        self.pool.release_many(reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0
        if seq.cpu_block_table:
            self._cpu_release_after_step.extend(seq.cpu_block_table)
            seq.cpu_block_table = []

    def roll_back(self, seq: Sequence) -> None:
        """Give back the blocks past seq's computed tokens: after a verification they hold only rejected draft
        tokens' KV (slots of rejected drafts in a kept block are simply overwritten by the next step)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())

    def reset_for_recompute(self, seq: Sequence) -> None:
        """Free seq's blocks, its computed ones registered first: its resumed prefill finds them cached."""
        self._register(seq, seq.num_computed_tokens // self.block_size)
        self._register_partial(seq)
        self.free(seq)
        seq.num_computed_tokens = 0

    # -- swapping ----------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.cpu_free) >= len(seq.block_table)

    def swap_out(self, seq: Sequence) -> None:
        cpu = [self.cpu_free.pop() for _ in seq.block_table]
        self.ops.swap_out.extend(zip(seq.block_table, cpu, strict=True))
        self.pool.release_many(reversed(seq.block_table))
        seq.block_table, seq.cpu_block_table = [], cpu

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Bring a swapped sequence back into fresh device blocks, with room for its next tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        if total > self.pool.num_free:
            return False
        dev = self.pool.allocate_many(total)
        self.ops.swap_in.extend(zip(seq.cpu_block_table, dev, strict=False))
        self._cpu_release_after_step.extend(seq.cpu_block_table)
        seq.block_table, seq.cpu_block_table = dev, []
        # Fresh blocks are not in the prefix cache: re-register them as they are (hashes stay valid).
        if self.pool.enable_caching:
            full = seq.num_computed_tokens // self.block_size
            for i, h in enumerate(seq.block_hashes[:full]):
                self.pool.cache(dev[i], h, self._content(seq, i))
            seq.num_registered_blocks = full
        return True

    def take_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        return ops

    def end_step(self) -> None:
        """CPU blocks read by this step's swap-ins may be reused from the next step on."""
        # pushed in reverse, so that the next swap-out pops them in ascending order: a sequence's CPU blocks stay one
        # run, which the runner copies as one slice per layer
        self.cpu_free.extend(reversed(self._cpu_release_after_step))
        self._cpu_release_after_step = []
        if self._release_after_step:  # the partial prefix hits' sources, copied by now
            self.pool.release_many(self._release_after_step)
            self._release_after_step = []

    # -- stats -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
