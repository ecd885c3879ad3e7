"""The prefix cache: a radix tree over token ids whose values are KV pages shared by every runner.

The target and every draft runner hold a token's KV at the same slot (one allocator, one index
space), so one tree serves them all: a node's `pages` are valid in every runner's pool at once, and
the memory manager writes a hit's slots into every runner's request-to-token map. What goes in is
the caller's promise that those pages hold KV for the node's tokens in *every* runner (the workers
say how far that holds, see `TargetWorker.kv_valid_len`). Keys are cut at page boundaries (a node's
key is a whole number of pages; with page_size 1 a page is a slot). A node in use by a request is
locked (`lock`, counted along its path to the root) and never evicted; unlocked nodes are
evictable, and `evict` frees least-recently-used leaves first. Nodes split where a new key diverges,
as in SGLang's RadixCache (python/sglang/srt/mem_cache/radix_cache.py), which this follows.
Eviction does not walk the tree: once the pool is full of cached prefixes every arrival and every
decoding request's next block of pages evicts, and a walk costs the engine loop time in proportion to
everything cached. A heap of the unlocked leaves by last use is kept as they change instead (an entry
is pushed whenever a node becomes an unlocked leaf or such a leaf is used again; entries that no longer
hold are skipped when they surface, and the heap is rebuilt once they outnumber the nodes), so an
eviction costs O(log n) per leaf it frees, in the same order a walk would give.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from mleagle.engine.memory.allocator import SlotAllocator

ChildKey = int | tuple[int, ...]


class Node:
    __slots__ = ("children", "id", "key", "lock", "pages", "parent", "stamp")
    # (`parent` is None for the root and for a node evicted from the tree)
    _ids = itertools.count()

    def __init__(self, key: list[int], pages: list[int], parent: Node | None, stamp: int = 0):
        self.key = key  # tokens of this edge (a whole number of pages)
        self.pages = pages  # len(key) // page_size pages holding their KV
        self.children: dict[ChildKey, Node] = {}
        self.parent = parent
        self.lock = 0  # requests using this node (or a descendant) as their cached prefix
        self.stamp = stamp  # last use (the cache's clock), for LRU eviction
        self.id = next(Node._ids)


class RadixCache:
    def __init__(self, allocator: SlotAllocator):
        self.alloc = allocator
        self.page_size = allocator.page_size
        self.root = Node([], [], None)
        self.root.lock = 1  # the root is never evicted
        self.cached_tokens = 0  # tokens in the tree
        self.evictable_tokens = 0  # tokens in unlocked nodes
        self.evicted_tokens = 0  # cumulative
        self.num_nodes = 0  # below the root
        self._clock = itertools.count(1)
        # (stamp, id, push count, node) for unlocked leaves, pushed as they appear or are used again (a
        # node may have several entries of one stamp: the count keeps the nodes themselves from being
        # compared); an entry holds while its node is still in the tree, a leaf, unlocked and of that
        # stamp (see `_holds`).
        self._heap: list[tuple[int, int, int, Node]] = []
        self._pushes = itertools.count()

    # --- the eviction heap -------------------------------------------------------------------------
    def _offer(self, n: Node) -> None:
        """`n` may have become an unlocked leaf, or been used again as one: give it an entry."""
        if not n.children and n.lock == 0 and n.parent is not None:
            heapq.heappush(self._heap, (n.stamp, n.id, next(self._pushes), n))
            if len(self._heap) > 2 * self.num_nodes + 64:  # mostly entries that no longer hold
                self._heap = [x for x in self._heap if self._holds(x)]
                heapq.heapify(self._heap)

    @staticmethod
    def _holds(x: tuple[int, int, int, Node]) -> bool:
        stamp, _, _, n = x
        return n.parent is not None and not n.children and n.lock == 0 and n.stamp == stamp

    # --- lookup and insertion --------------------------------------------------------------------
    def _ck(self, ids: list[int], i: int) -> ChildKey:
        return ids[i] if self.page_size == 1 else tuple(ids[i : i + self.page_size])

    def _common(self, key: list[int], ids: list[int], i: int) -> int:
        """Length of the common prefix of `key` and `ids[i:]`, rounded down to whole pages. Compared by
        list slices (C speed) and, where they differ, a binary search for the first mismatch: a match or
        an insert walks a long conversation's whole history on the engine loop, and a Python loop per
        token cost 220 µs for 4,000 tokens on the development VM."""
        n = min(len(key), len(ids) - i)
        if key[:n] == ids[i : i + n]:
            j = n
        else:
            lo, hi = 0, n  # key[:lo] matches; the first mismatch is in [lo, hi)
            while hi - lo > 16:
                mid = (lo + hi) // 2
                if key[lo:mid] == ids[i + lo : i + mid]:
                    lo = mid
                else:
                    hi = mid
            j = lo
            while j < hi and key[j] == ids[i + j]:
                j += 1
        return j - j % self.page_size

    def _split(self, child: Node, m: int) -> Node:
        """Cut `child`'s edge after m tokens; returns the new upper node (same lock, same stamp)."""
        p = self.page_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key) and m % p == 0
        up = Node(child.key[:m], child.pages[: m // p], parent, child.stamp)
        up.lock = child.lock
        self.num_nodes += 1
        parent.children[self._ck(up.key, 0)] = up
        child.key, child.pages, child.parent = child.key[m:], child.pages[m // p :], up
        up.children[self._ck(child.key, 0)] = child
        return up

    def match(self, ids: list[int]) -> tuple[list[int], Node]:
        """The pages of the longest cached prefix of `ids` (whole pages) and the node it ends at.
        The caller locks that node before anything can evict it."""
        ids = ids[: len(ids) - len(ids) % self.page_size]
        n = len(ids)
        now = next(self._clock)
        node, i, pages = self.root, 0, []
        while i < n:
            child = node.children.get(self._ck(ids, i))
            if child is None:
                break
            m = self._common(child.key, ids, i)
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.stamp = now
            self._offer(child)  # (the caller usually locks it next; if not, it is a fresher leaf now)
            pages += child.pages
            i += m
            node = child
        return pages, node

    def insert(self, ids: list[int], pages: list[int]) -> int:
        """Add `ids` (len(pages) whole pages) with their pages; returns how many leading tokens the
        tree already held (their pages in `pages` are duplicates the caller frees)."""
        p = self.page_size
        n = len(pages) * p
        if len(ids) < n:
            raise ValueError(f"insert: {len(ids)} ids for {len(pages)} pages of {p}")
        ids = ids[:n]
        now = next(self._clock)
        node, i = self.root, 0
        while i < n:
            child = node.children.get(self._ck(ids, i))
            if child is None:
                new = Node(ids[i:], pages[i // p :], node, now)
                node.children[self._ck(ids, i)] = new
                self.num_nodes += 1
                self.cached_tokens += n - i
                self.evictable_tokens += n - i
                self._offer(new)
                return i
            m = self._common(child.key, ids, i)
            if m < len(child.key):
                child = self._split(child, m)
            child.stamp = now
            self._offer(child)
            i += m
            node = child
        return n

    # --- reference counts --------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """A request uses the prefix ending at `node`: it and its ancestors stop being evictable."""
        while node is not self.root:
            if node.lock == 0:
                self.evictable_tokens -= len(node.key)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock <= 0:
                raise RuntimeError(f"prefix cache: unlock of an unlocked node {node.id}")  # a bookkeeping bug
            node.lock -= 1
            if node.lock == 0:
                self.evictable_tokens += len(node.key)
                self._offer(node)
            node = node.parent  # type: ignore[assignment]

    # --- eviction ----------------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` (if that many are evictable), least recently used leaves first;
        returns the tokens freed. A parent left childless and unlocked becomes a candidate in turn."""
        heap = self._heap
        freed = 0
        while freed < num_tokens and heap:
            x = heapq.heappop(heap)
            if not self._holds(x):
                continue
            leaf = x[3]
            self.alloc.free(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._ck(leaf.key, 0)]
            leaf.parent = None
            self.num_nodes -= 1
            freed += len(leaf.key)
            if parent is not self.root:
                self._offer(parent)
        self.cached_tokens -= freed
        self.evictable_tokens -= freed
        self.evicted_tokens += freed
        return freed

    def reset(self) -> int:
        """Evict everything unlocked (a flush); returns the tokens freed."""
        return self.evict(self.evictable_tokens)

    # --- checks --------------------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Recount the tree and compare with the running totals; returns what is wrong (tests)."""
        bad: list[str] = []
        p = self.page_size
        cached = evictable = count = 0
        pages: set[int] = set()
        indexed = {x[1] for x in self._heap if self._holds(x)}
        for n in self.nodes():
            count += 1
            if not n.children and n.lock == 0 and n.id not in indexed:
                bad.append(f"node {n.id}: an unlocked leaf missing from the eviction heap")
            if not n.key or len(n.key) % p or len(n.pages) * p != len(n.key):
                bad.append(f"node {n.id}: key of {len(n.key)} tokens with {len(n.pages)} pages of {p}")
            if n.lock < 0:
                bad.append(f"node {n.id}: negative lock {n.lock}")
            locked_children = sum(c.lock for c in n.children.values())
            if n.lock < locked_children:
                bad.append(f"node {n.id}: lock {n.lock} below its children's {locked_children}")
            if pages & set(n.pages):
                bad.append(f"node {n.id}: a page held twice in the tree")
            pages |= set(n.pages)
            cached += len(n.key)
            evictable += len(n.key) if n.lock == 0 else 0
        if cached != self.cached_tokens or evictable != self.evictable_tokens or count != self.num_nodes:
            bad.append(f"totals: cached {self.cached_tokens} (recount {cached}), "
                       f"evictable {self.evictable_tokens} (recount {evictable}), nodes {self.num_nodes} (recount {count})")
        return bad

    def pages(self) -> set[int]:
        return {pg for n in self.nodes() for pg in n.pages}
