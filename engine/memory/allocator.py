"""The slot allocator: one index space of KV pages shared by the target and every draft runner.

A slot is one token's KV entry; a page is `page_size` consecutive slots. Every runner's KV pool has
the same number of slots, so one `out_cache_loc` is valid in all of them. Slot 0..page_size-1 (page
0) is never handed out: padded rows write there, so padding can never overwrite a real request's KV.
"""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots < 2 * page_size:
            raise ValueError(f"KV pool too small: {num_slots} slots for page size {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))  # page 0 is the pad page
        self._is_free = bytearray(self.num_pages)
        for p in self.free_pages:
            self._is_free[p] = 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens a request could ever hold: every page but the pad page."""
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_tokens(self) -> int:
        return len(self.free_pages) * self.page_size

    @property
    def num_used_tokens(self) -> int:
        return self.capacity_tokens - self.num_free_tokens

    def alloc(self, n_pages: int) -> list[int] | None:
        if n_pages > len(self.free_pages):
            return None
        # the last n of the free list, last first: the order popping them one at a time gives, in C
        cut = len(self.free_pages) - n_pages
        pages = self.free_pages[cut:]
        pages.reverse()
        del self.free_pages[cut:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._is_free[p]:
                raise RuntimeError(f"double free or bad page {p}")  # a bookkeeping bug, never user input
            self._is_free[p] = 1
        self.free_pages.extend(pages)
