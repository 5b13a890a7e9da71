"""The pool of KV cache blocks: O(1) allocation, reference counts, and a prefix cache of full blocks."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_NO_SALT = bytes(32)  # the parent of an unsalted prompt's first block


def root_hash(cache_salt: str | None, adapter_key: str | None = None) -> bytes:
    """The "parent" of a prompt's first block: a cache salt (one per tenant) starts a separate chain, so
    blocks are never shared across salts; so does a LoRA adapter (its digest), whose keys and values differ
    from the base model's for the same tokens."""
    if not cache_salt and not adapter_key:
        return _NO_SALT
    salt = (cache_salt or "").encode("utf-8", "surrogatepass")
    if adapter_key:
        salt += b"\0servelm-lora\0" + adapter_key.encode()
    return hashlib.sha256(b"servelm-cache-salt\0" + salt).digest()


def block_preimage(parent_hash: bytes | None, token_ids: Sequence[int], num_prompt: int | None = None) -> bytes:
    """What a block's key is the hash of: the parent's 32-byte key, then the token ids as int64s, then, for
    a block that does not lie wholly in its sequence's prompt, a marker and how many of its tokens do:
    generated tokens' keys and values come from the decode path, prompt tokens' from the prefill path
    (different summation orders), so a later prompt must not reuse them as if it had computed them."""
    pre = (parent_hash or _NO_SALT) + array("q", token_ids).tobytes()
    return pre if num_prompt is None else pre + b"generated" + num_prompt.to_bytes(8, "little")


_PARTIAL = b"servelm-partial\0"  # leads the preimage of a partly filled block's key


def partial_preimage(parent_hash: bytes | None, token_ids: Sequence[int], num_prompt: int | None = None) -> bytes:
    """What the key of a partly filled block's first len(token_ids) slots hashes: a tag, then as block_preimage.
    Such a block is cached when its last sequence lets it go, and a later sequence that goes on from the same
    tokens copies it rather than computing them again (beam search's next step, a preempted sample resuming)."""
    return _PARTIAL + block_preimage(parent_hash, token_ids, num_prompt)


def is_partial(content: bytes) -> bool:
    """Whether a cached block's preimage is a partly filled block's (kv_persist saves full blocks only)."""
    return content.startswith(_PARTIAL)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], num_prompt: int | None = None) -> bytes:
    """Hash chain key of a full block: it identifies the block's tokens *and* everything before them.

    SHA-256, not Python's hash(): blocks are shared between requests, so a key must not collide, by chance
    or by a crafted prompt (hash() of a tuple of ints is 64 bits and easy to collide on purpose).
    """
    return block_key(block_preimage(parent_hash, token_ids, num_prompt))


def block_key(preimage: bytes) -> bytes:
    """The key of a block whose block_preimage is given."""
    return hashlib.sha256(preimage).digest()


class BlockPool:
    """Free blocks (refcount 0) sit in one of two places: a stack of blocks that hold nothing reusable,
    and an LRU queue of blocks that still hold a cached prefix (they keep their hash until reused).

    Allocation takes from the stack first, the most recently freed block, so a run keeps reusing the
    same warm, already-mapped memory (the pool's pages are mapped on first write: cycling through the
    whole pool would make every page resident). Only then does it evict the least recently used cached
    block, so cached prefixes survive as long as possible. A block found by a prefix-cache lookup
    leaves the queue while in use.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # what each cached block's key was computed from: a hit is served only if it matches exactly, so
        # even a hash collision cannot hand one prompt's KV to another
        self.block_content: list[bytes | None] = [None] * num_blocks
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 on top
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def allocate(self) -> int:
        if self.free_plain:  # the common case, kept to one pop
            block = self.free_plain.pop()
            self.ref_counts[block] = 1
            return block
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """n blocks, in the order n allocations one by one would give them: the plain stack's top first, then
        the least recently used cached blocks, evicted. One call, not n, because this runs for every block a
        prompt needs (a 1k-token prompt takes 64)."""
        if n > self.num_free:
            raise RuntimeError("KV block pool exhausted; the scheduler must check num_free first")
        plain = self.free_plain
        k = min(n, len(plain))
        blocks = plain[len(plain) - k:]
        del plain[len(plain) - k:]
        blocks.reverse()
        if k < n:
            pop, hashes, contents, cached = self.free_cached.popitem, self.block_hash, self.block_content, self.cached
            for _ in range(n - k):
                block = pop(last=False)[0]
                h = hashes[block]
                if h is not None:  # evict its prefix (inlined: once per block of every long prompt)
                    hashes[block] = contents[block] = None
                    if cached.get(h) == block:
                        del cached[h]
                    self.num_evictions += 1
                blocks.append(block)
        ref_counts = self.ref_counts
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    def take(self, block: int) -> None:
        """Add a reference to an existing block (a prefix-cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            if block in self.free_cached:  # a lookup hit: free blocks that hold a prefix wait there
                del self.free_cached[block]
            else:
                self.free_plain.remove(block)
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.release_many((block,))

    def release_many(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, in this order: a block that becomes free joins its queue last
        (the plain stack's top, or the cached queue's most recent end, evicted last)."""
        ref_counts, hashes, contents = self.ref_counts, self.block_hash, self.block_content
        caching, plain, cached = self.enable_caching, self.free_plain, self.free_cached
        for block in blocks:
            left = ref_counts[block] - 1
            if left < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            ref_counts[block] = left
            if left == 0:
                if not caching:
                    hashes[block] = contents[block] = None
                if hashes[block] is None:
                    plain.append(block)
                else:
                    cached[block] = None

    def lookup(self, block_hash: bytes, content: bytes = b"") -> int | None:
        """The cached block under this key whose stored content (the key's preimage) is `content`."""
        if not self.enable_caching:
            return None
        block = self.cached.get(block_hash)
        if block is None or self.block_content[block] != content:
            return None
        return block

    def cache(self, block: int, block_hash: bytes, content: bytes = b"") -> None:
        """Register a block that just became full under its hash (first writer wins)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash
            self.block_content[block] = content

    def num_taken_from_free(self, blocks: Sequence[int]) -> int:
        """How many of these blocks would leave the free queue if taken."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def reset_prefix_cache(self, in_use: bool = False) -> None:
        """Forget the cached prefixes of the free blocks; with `in_use`, also of the blocks requests hold now
        (their requests keep them, and no later request matches them: weights changed under held requests)."""
        for h, b in list(self.cached.items()):
            if self.ref_counts[b] == 0:
                self.block_hash[b] = self.block_content[b] = None
                del self.cached[h]
                del self.free_cached[b]
                self.free_plain.append(b)
            elif in_use:
                self.block_hash[b] = self.block_content[b] = None
                del self.cached[h]

    # -- persistence (servelm.engine.kv_persist) ---------------------------------------------------
    def cached_blocks(self) -> list[tuple[int, bytes, bytes]]:
        """(block, key, content) of every cached block, least recently used first: free ones in eviction
        order, then those in use now (their computed contents are as recent as it gets)."""
        free = [b for b in self.free_cached]
        in_use = [b for b in self.cached.values() if self.ref_counts[b] > 0]
        out = []
        for b in free + in_use:
            h, content = self.block_hash[b], self.block_content[b]
            if h is not None and content is not None and self.cached.get(h) == b:
                out.append((b, h, content))
        return out

    def take_plain(self) -> int | None:
        """A free block that holds nothing reusable, or None: restoring never evicts a cached prefix."""
        return self.free_plain.pop() if self.free_plain else None

    def return_plain(self, blocks: Sequence[int]) -> None:
        """Give back blocks from take_plain() that were not restored (a rejected file)."""
        self.free_plain.extend(reversed(blocks))

    def restore_cached(self, block: int, block_hash: bytes, content: bytes) -> None:
        """Register a block from take_plain(), its contents already written, as a free cached block (the most
        recently used one)."""
        self.block_hash[block], self.block_content[block] = block_hash, content
        self.cached[block_hash] = block
        self.free_cached[block] = None
