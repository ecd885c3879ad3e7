"""The memory manager: request slots, KV pages and the prefix cache for every runner, in one place.

It owns the shared `SlotAllocator`, a free list of request slots and (unless disabled) the
`RadixCache`, and it writes each allocation into every runner's request-to-token map, so the target
and all draft runners always agree on which slot holds which position. A request starts with
`match` (the longest cached prefix of its tokens, locked, its pages written into every map by the
first `ensure`), grows by `ensure(req, n)` (which evicts unused cached prefixes before it fails), and
gives everything back with `release(req, keep)`, whatever way it ended: the KV of `keep` (the tokens
whose KV is valid in every runner) goes into the cache, the prefix is unlocked, the rest is freed.
`audit` checks that every page has exactly one owner (tests run it after every step). With
`hold_frees` (a prefill on a stream of its own, beside the iteration in flight), what a finished request
gives back waits until the iterations that may still touch it have ended (`settle`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from mleagle.engine.memory.allocator import SlotAllocator
from mleagle.engine.memory.radix_cache import RadixCache
from mleagle.engine.memory.req_to_token import ReqToTokenPool


def page_slots(pages: Sequence[int], page_size: int, n: int | None = None) -> np.ndarray:
    """The KV slots of positions 0..n-1 (all the pages' positions by default) of a request holding
    `pages`: position p lives in slot pages[p // page_size] * page_size + p % page_size."""
    if page_size == 1:  # a page is a slot (the default): no index arithmetic, a third of the time
        slots = np.asarray(pages, dtype=np.int64)
        return slots if n is None else slots[:n]
    pos = np.arange(len(pages) * page_size if n is None else n)
    return np.asarray(pages, dtype=np.int64)[pos // page_size] * page_size + pos % page_size


class HoldsKV(Protocol):
    req_pool_idx: int | None
    pages: list[int]
    prefix_node: Any  # the locked cache node the request's prefix ends at (None: no cached prefix)
    cached_len: int  # tokens at the front of `pages` that belong to the cache (a whole number of pages)


class MemoryManager:
    def __init__(self, allocator: SlotAllocator, maps: list[ReqToTokenPool], prefix_cache: bool = False):
        self.allocator = allocator
        self.maps = maps
        self.max_reqs = maps[0].max_reqs
        self.max_context = maps[0].max_context
        self.free_reqs: list[int] = list(range(self.max_reqs - 1, -1, -1))
        self.cache: RadixCache | None = RadixCache(allocator) if prefix_cache else None
        # Called with the pages `ensure` hands a request (their old contents mean nothing now): a
        # speculative worker forgets what it knew of them (`SpecWorker.forget_pages`).
        self.on_alloc: list[Callable[[list[int]], None]] = []
        # Held frees (`hold_frees`): (launches counted when freed, pages, request slot), given back by
        # `settle` once every iteration launched by then has ended. None: frees are immediate.
        self.held: list[tuple[int, list[int], int | None]] | None = None
        self.launches = 0  # iterations the scheduler has launched (`settle`'s clock)

    def hold_frees(self) -> None:
        """Keep what a finished request gives back from reuse until the iterations that may still touch it
        have ended (`settle`). Needed when a prefill runs on a stream of its own beside the iteration in
        flight: that iteration, launched before the request was known to be done, still writes its row's
        slot state and the KV slot after its last token, so a new request given that row or page in the
        meantime would be overwritten behind its prefill. Cached prefixes are not held: an iteration only
        reads them (a live request's are locked), and eviction must free at once."""
        self.held = []

    def settle(self, launched: int | None = None) -> None:
        """The iterations launched up to the `launched`-th (all of them: None) have ended: what was freed
        while only they could still touch it becomes free."""
        if not self.held:
            return
        keep = []
        for tag, pages, slot in self.held:
            if launched is None or tag <= launched:
                self._give_back(pages, slot)
            else:
                keep.append((tag, pages, slot))
        self.held = keep

    def _free(self, pages: list[int], slot: int | None = None) -> None:
        """Free a request's pages and its slot, or hold them (`hold_frees`)."""
        if self.held is None:
            self._give_back(pages, slot)
        elif pages or slot is not None:
            self.held.append((self.launches, list(pages), slot))

    def _give_back(self, pages: list[int], slot: int | None) -> None:
        if pages:
            self.allocator.free(pages)
        if slot is not None:
            self.free_reqs.append(slot)

    def add_map(self, m: ReqToTokenPool) -> None:
        if m.max_reqs != self.max_reqs or m.max_context != self.max_context:
            raise ValueError("every runner's request-to-token map must have the same shape")
        self.maps.append(m)

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @property
    def evictable_pages(self) -> int:
        return self.cache.evictable_tokens // self.page_size if self.cache is not None else 0

    @property
    def num_used_tokens(self) -> int:
        """Slots held by requests (their own pages and the cached prefixes they lock); slots only the
        cache holds are reusable at any time and count as free here, as in vLLM's and SGLang's usage."""
        a = self.allocator
        return a.capacity_tokens - a.num_free_tokens - (self.cache.evictable_tokens if self.cache else 0)

    # --- the prefix cache ----------------------------------------------------------------------------
    def match(self, req: HoldsKV, ids: list[int], margin: int = 0) -> int:
        """Lock the longest cached prefix of `ids` (whole pages) for a request that holds nothing and
        make it the front of its pages; returns its length in tokens (0 without a cache). `margin`
        tokens are left off the end of the match (then whole pages): KV there may have been computed
        from tokens past the prefix (a draft layer reads ahead), which this request does not share."""
        if req.pages or req.req_pool_idx is not None:
            raise RuntimeError("match: the request already holds KV")
        if self.cache is None or not ids:
            return 0
        pages, node = self.cache.match(ids)
        keep = max(0, len(pages) * self.page_size - margin) // self.page_size
        if keep < len(pages):
            pages, node = self.cache.match(ids[: keep * self.page_size])
        if not pages:
            return 0
        self.cache.lock(node)
        req.pages, req.prefix_node, req.cached_len = list(pages), node, len(pages) * self.page_size
        return req.cached_len

    def unmatch(self, req: HoldsKV) -> None:
        """Give a matched prefix back untouched (the request was not admitted after all)."""
        if req.req_pool_idx is not None:
            raise RuntimeError("unmatch: the request was already given a request slot")
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)  # type: ignore[union-attr]
        req.pages, req.prefix_node, req.cached_len = [], None, 0

    def _take(self, n_pages: int) -> list[int] | None:
        """n pages from the allocator, evicting least recently used cached prefixes if it is short."""
        short = n_pages - len(self.allocator.free_pages)
        if short > 0 and self.cache is not None:
            self.cache.evict(short * self.page_size)
        return self.allocator.alloc(n_pages)

    # --- requests -----------------------------------------------------------------------------------
    def pages_needed(self, req: HoldsKV, new_len: int) -> int:
        return max(0, -(-new_len // self.page_size) - len(req.pages))

    def can_ensure(self, req: HoldsKV, new_len: int, reserve_pages: int = 0) -> bool:
        need = self.pages_needed(req, new_len) + reserve_pages
        have = len(self.allocator.free_pages) + self.evictable_pages
        return need <= have and (req.req_pool_idx is not None or bool(self.free_reqs))

    def covers(self, req: HoldsKV, new_len: int) -> bool:
        """`req` holds slots for positions [0, new_len) already: most decode steps of most requests
        (`ensure`'s first check, which the scheduler asks of every running request every step)."""
        return req.req_pool_idx is not None and new_len <= len(req.pages) * self.allocator.page_size

    def ensure(self, req: HoldsKV, new_len: int, grow: int = 0) -> bool:
        """Give `req` slots for positions [0, new_len). False (nothing changed) if the pool is short.

        `grow` asks for up to that many more positions while free pages allow (never by evicting), so a
        decoding request takes pages in blocks and most steps need no allocation and no map write."""
        if new_len > self.max_context:
            raise ValueError(f"position {new_len} beyond the request-to-token map ({self.max_context})")
        if self.covers(req, new_len):
            return True
        if req.req_pool_idx is None:
            if not self.free_reqs:
                return False
        need = self.pages_needed(req, new_len)
        if need and grow:
            top = max(new_len, min(new_len + grow, self.max_context // self.page_size * self.page_size))
            more = min(self.pages_needed(req, top) - need, len(self.allocator.free_pages) - need)
            need += max(more, 0)
        pages = self._take(need) if need else []
        if pages is None:
            return False
        for f in self.on_alloc:
            f(pages)
        start = len(req.pages) * self.page_size
        req.pages.extend(pages)
        if req.req_pool_idx is None:  # a new request: its cached prefix's pages and the new ones in one write
            req.req_pool_idx = self.free_reqs.pop()
            self._write(req, 0, req.pages)
        elif pages:
            self._write(req, start, pages)
        return True

    def _write(self, req: HoldsKV, start: int, pages: list[int]) -> None:
        if not pages:
            return
        slots = torch.from_numpy(page_slots(pages, self.page_size))
        row, end = req.req_pool_idx, start + len(slots)
        there: torch.Tensor | None = None  # the slots on the device, for a group's broadcast write
        written: set[int] = set()
        for m in self.maps:  # every runner's map (the target's, each draft layer's) from one host array
            if m.group is None:  # a row's slice: straight from the host, one copy (no upload, then a copy)
                m.req_to_token[row, start:end].copy_(slots, non_blocking=True)
                continue
            if id(m.group) in written:  # its group was written whole (`ReqToTokenPool.stacked`)
                continue
            written.add(id(m.group))
            if there is None or there.device != m.group.device:
                there = slots.to(m.group.device, non_blocking=True)
            m.group[:, row, start:end] = there

    def release(self, req: HoldsKV, keep: list[int] | None = None) -> None:
        """Give back everything `req` holds. `keep` are the leading tokens whose KV is valid in every
        runner's pool: their whole pages go into the prefix cache (pages the cache already held for
        the same tokens are freed as duplicates); everything else is freed."""
        p = self.page_size
        own = req.cached_len // p  # pages before this index belong to the cache
        if self.cache is not None and keep:
            n = min(len(keep) // p, len(req.pages))
            if n > own:
                present = self.cache.insert(keep[: n * p], req.pages[:n]) // p
                self._free(req.pages[own : max(own, present)])
                own = n
        self._free(req.pages[own:], req.req_pool_idx)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)  # type: ignore[union-attr]
        req.pages, req.prefix_node, req.cached_len = [], None, 0
        req.req_pool_idx = None

    def reset_cache(self) -> int:
        """Evict every cached prefix no request uses; returns the tokens freed."""
        return self.cache.reset() if self.cache is not None else 0

    @property
    def num_used_reqs(self) -> int:
        return self.max_reqs - len(self.free_reqs)

    # --- checks -------------------------------------------------------------------------------------
    def audit(self, reqs: list[Any], check_locks: bool = True) -> list[str]:
        """Every page has exactly one owner: the free list, the cache, or one live request (its pages
        after `cached_len`); a live request's cached prefix is in the tree; with `check_locks`, every
        node's lock count equals the live requests using it. Returns what is wrong (empty when all is
        well)."""
        bad: list[str] = []
        p = self.page_size
        free = set(self.allocator.free_pages) | {x for _, pages, _ in self.held or [] for x in pages}
        if len(free) != len(self.allocator.free_pages) + sum(len(pages) for _, pages, _ in self.held or []):
            bad.append("a page twice in the free list (or held)")
        tree = self.cache.pages() if self.cache is not None else set()
        if self.cache is not None:
            bad += self.cache.check()
        owned: set[int] = set()
        locks: dict[int, int] = {}
        for r in reqs:
            own = r.pages[r.cached_len // p :]
            prefix = r.pages[: r.cached_len // p]
            if owned & set(own) or len(set(own)) != len(own):
                bad.append(f"{getattr(r, 'rid', '?')}: a page owned twice")
            owned |= set(own)
            if set(prefix) - tree:
                bad.append(f"{getattr(r, 'rid', '?')}: cached prefix pages not in the tree (freed while in use)")
            if r.cached_len and r.prefix_node is None:
                bad.append(f"{getattr(r, 'rid', '?')}: a cached prefix without a locked node")
            node = r.prefix_node
            while node is not None and node.parent is not None:
                locks[node.id] = locks.get(node.id, 0) + 1
                node = node.parent
        if free & tree or free & owned or tree & owned:
            bad.append(f"pages with two owners: free&tree {len(free & tree)}, free&req {len(free & owned)}, "
                       f"tree&req {len(tree & owned)}")
        everything = set(range(1, self.allocator.num_pages))
        lost = everything - free - tree - owned
        if lost:
            bad.append(f"{len(lost)} pages owned by nobody (leaked)")
        if self.cache is not None and check_locks:
            for n in self.cache.nodes():
                if n.lock != locks.get(n.id, 0):
                    bad.append(f"node {n.id}: lock {n.lock}, but {locks.get(n.id, 0)} live requests use it")
        return bad

    def idle_problems(self) -> list[str]:
        """With no request alive: every page free or evictable in the cache, no lock left, every
        request slot free (what "nothing leaks" means with a prefix cache)."""
        bad = self.audit([])
        if self.held:
            bad.append(f"idle: {len(self.held)} frees still held")
        a = self.allocator
        evictable = self.cache.evictable_tokens if self.cache is not None else 0
        if a.num_free_tokens + evictable != a.capacity_tokens:
            bad.append(f"idle: {a.num_free_tokens} free + {evictable} evictable != {a.capacity_tokens} tokens")
        if sorted(self.free_reqs) != list(range(self.max_reqs)):
            bad.append("idle: request slots not all free")
        return bad
