"""PyTorch's CUDA caching allocator, replayed over a trace's storages: the memory the GPU
really holds (reserved segments), beside what tensors use (allocated), and whether a step
stays under a memory line once the allocator has freed its cache and retried
(docs/references.md, section 31).

A model of c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator, PyTorch 2.13), rule by
rule: ``round_size`` and the small (<= 1 MiB) and large pools; a best-fit search over the
pool's free blocks of the stream by (size, address) (``get_free_block``) with its
``max_split_size`` rules; a new segment when none fits (``alloc_block``, sized by
``get_allocation_size``); splitting (``should_split``); coalescing a freed block with its
free neighbours (``free_block``, ``try_merge_blocks``); on a failed cudaMalloc, releasing
oversize cached blocks and then every unsplit cached segment before retrying
(``release_available_cached_blocks``, ``release_cached_blocks``); expandable segments, one
per stream and pool, mapped in 2 MiB pages (small pool) or 20 MiB pages (large pool)
(``find_expandable_block``, ``map_block``, ``unmap_block``).

Not modelled: cross-stream uses (record_stream's events), CUDA graph private pools,
garbage_collection_threshold, the driver's own memory and the CUDA context. Addresses are
handed out in increasing order, the one thing cudaMalloc does not promise: they only break
ties between cached blocks of equal size. tilefit.estimator.allocator_replay replays a trace
through it."""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Literal

from tilefit.alloc_conf import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    allocation_size,
    round_size,
)

__all__ = ["Allocator", "Block", "SegmentInfo"]

# an expandable segment reserves address space for this many pages, more than a GPU holds
# (PyTorch reserves 1 1/8 of the device's memory: ExpandableSegment's constructor)
VIRTUAL_PAGES = 1 << 20


class Block:
    """A range of a segment, free or allocated; prev/next: its neighbours in the segment."""

    __slots__ = ("addr", "allocated", "mapped", "next", "prev", "seg", "size")

    def __init__(self, addr: int, size: int, seg: _Segment, *, mapped: bool = True) -> None:
        self.addr, self.size, self.seg, self.mapped = addr, size, seg, mapped
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


def _link(a: Block | None, b: Block | None) -> None:
    if a is not None:
        a.next = b
    if b is not None:
        b.prev = a


class _Pool:
    """One stream's small or large pool: its free blocks by (size, address), and the
    unmapped ranges of its expandable segments by address."""

    def __init__(self, stream: int, small: bool) -> None:
        self.stream, self.small = stream, small
        self.free: list[tuple[int, int]] = []
        self.by_addr: dict[int, Block] = {}
        self.unmapped: list[int] = []
        self.unmapped_by_addr: dict[int, Block] = {}

    def add(self, b: Block) -> None:
        insort(self.free, (b.size, b.addr))
        self.by_addr[b.addr] = b

    def remove(self, b: Block) -> None:
        del self.free[bisect_left(self.free, (b.size, b.addr))]
        del self.by_addr[b.addr]

    def add_unmapped(self, b: Block) -> None:
        insort(self.unmapped, b.addr)
        self.unmapped_by_addr[b.addr] = b

    def remove_unmapped(self, b: Block) -> None:
        del self.unmapped[bisect_left(self.unmapped, b.addr)]
        del self.unmapped_by_addr[b.addr]

    def block(self, i: int) -> Block:
        return self.by_addr[self.free[i][1]]

    def lower_bound(self, size: int) -> int:
        """The smallest free block of at least ``size`` bytes, lowest address first."""
        return bisect_left(self.free, (size, -1))


@dataclass(eq=False)
class _Segment:
    base: int
    pool: _Pool
    expandable: bool
    page: int  # an expandable segment's page; 0 for a cudaMalloc'ed one
    tag: int | None  # the request that created it
    request: int  # its bytes
    reserved: int = 0  # bytes it holds: its size, or an expandable one's mapped pages


@dataclass(frozen=True)
class SegmentInfo:
    """A segment the allocator holds: ``size`` bytes reserved (an expandable segment: its
    mapped pages), created by the request of storage ``request_uid``."""

    size: int
    pool: Literal["small", "large"]
    stream: int
    expandable: bool
    request_uid: int | None
    request_bytes: int


class Allocator:
    """The caching allocator's state under ``config``; ``limit_bytes``: the memory it may
    reserve (what cudaMalloc can get), None for no line. malloc returns None where PyTorch
    raises OutOfMemoryError."""

    def __init__(self, config: AllocatorConfig, limit_bytes: int | None = None) -> None:
        self.config, self.limit = config, limit_bytes
        self.pools: dict[tuple[int, bool], _Pool] = {}
        self.segments: dict[int, _Segment] = {}
        self.reserved = self.allocated = 0
        self.released = 0  # bytes the cache releases on failed allocations gave back
        self.retried = 0  # allocations that succeeded only after releasing the cache
        # memory_stats()['num_alloc_retries']: alloc_block calls after release_cached_blocks
        # (isRetry), whether or not they then succeed
        self.retries = 0
        self.segments_created = 0
        self._next_addr = 0
        self._rounded: dict[int, int] = {}  # request -> round_size (a step repeats its sizes)

    # ---- malloc and free ------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0, tag: int | None = None) -> Block | None:
        """DeviceCachingAllocator::malloc: a cached block, else a new segment, else the
        cache released and a new segment again; None if even that fails."""
        size = self._rounded.get(nbytes)
        if size is None:
            size = self._rounded[nbytes] = round_size(self.config, nbytes)
        small = size <= K_SMALL_SIZE
        pool = self.pools.get((stream, small)) or self.pools.setdefault(
            (stream, small), _Pool(stream, small))
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_with_retries(pool, size, tag, nbytes)
        if block is None:
            return None
        if self._should_split(block, size):
            block = self._split(pool, block, size)
        block.allocated = True
        self.allocated += block.size
        return block

    def free(self, block: Block) -> None:
        """free_block: the block joins its free neighbours and goes back to its pool."""
        block.allocated = False
        self.allocated -= block.size
        pool = block.seg.pool
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add(block)

    def empty_cache(self) -> int:
        """release_cached_blocks (torch.cuda.empty_cache): every unsplit cached segment
        and every free page of the expandable segments goes back; the bytes released."""
        before = self.reserved
        for pool in self.pools.values():
            for block in [pool.block(i) for i in range(len(pool.free))]:
                if block.seg.expandable:
                    self._unmap(pool, block)
                elif not block.is_split:
                    self._release_block(pool, block)
        return before - self.reserved

    @property
    def live_segments(self) -> int:
        """Segments holding memory (an expandable one with no page mapped holds none)."""
        return sum(1 for s in self.segments.values() if s.reserved > 0) \
            if self.config.expandable_segments else len(self.segments)

    def segment_infos(self) -> tuple[SegmentInfo, ...]:
        return tuple(SegmentInfo(s.reserved, "small" if s.pool.small else "large",
                                 s.pool.stream, s.expandable, s.tag, s.request)
                     for s in self.segments.values() if s.reserved > 0)

    # ---- finding a block -----------------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> Block | None:
        """get_free_block: best fit, but an oversize block (>= max_split_size) serves only
        an oversize request, and one at most max_non_split_rounding larger."""
        i = pool.lower_bound(size)
        if i == len(pool.free):
            return None
        if self.config.expandable_segments:
            i = self._least_expandable(pool, i)
        block = pool.block(i)
        cap = self.config.max_split_size_bytes
        if cap is not None and size < cap <= block.size:
            return None
        if cap is not None and size >= cap and \
                block.size >= size + self.config.max_non_split_rounding_bytes:
            return None
        pool.remove(block)
        return block

    @staticmethod
    def _least_expandable(pool: _Pool, i: int) -> int:
        """With expandable segments a block before unmapped pages counts as what it can grow
        to: the search moves on to larger blocks that can grow less."""
        def grows_to(b: Block) -> int:
            tail = b.next
            return b.size + (tail.size if tail is not None and not tail.mapped else 0)
        while i + 1 < len(pool.free) and grows_to(pool.block(i + 1)) < grows_to(pool.block(i)):
            i += 1
        return i

    def _should_split(self, block: Block, size: int) -> bool:
        """should_split: the small pool and expandable segments split any 512-byte rest; a
        large block splits when the rest exceeds 1 MiB and the request is not oversize."""
        rest = block.size - size
        if block.seg.pool.small or self.config.expandable_segments:
            return rest >= 512
        cap = self.config.max_split_size_bytes
        return (cap is None or size < cap) and rest > K_SMALL_SIZE

    def _split(self, pool: _Pool, block: Block, size: int) -> Block:
        """alloc_found_block: the request takes the front; the rest goes back to the pool."""
        head = Block(block.addr, size, block.seg)
        _link(block.prev, head)
        _link(head, block)
        block.addr += size
        block.size -= size
        pool.add(block)
        return head

    def _merge(self, pool: _Pool, dst: Block, src: Block | None) -> None:
        """try_merge_blocks: ``dst`` absorbs a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        (pool.remove if src.mapped else pool.remove_unmapped)(src)
        if dst.prev is src:
            dst.addr = src.addr
            _link(src.prev, dst)
        else:
            _link(dst, src.next)
        dst.size += src.size

    # ---- new segments and the cache's release --------------------------------------------
    def _alloc_with_retries(self, pool: _Pool, size: int, tag: int | None,
                            nbytes: int) -> Block | None:
        """malloc's chain: alloc_block, else release_available_cached_blocks and
        alloc_block, else release_cached_blocks and alloc_block once more."""
        block = self._alloc_block(pool, size, tag, nbytes)
        if block is not None:
            return block
        if self._release_available(pool, size):
            block = self._alloc_block(pool, size, tag, nbytes)
        if block is None:
            self.released += self.empty_cache()
            self.retries += 1
            block = self._alloc_block(pool, size, tag, nbytes)
        if block is not None:
            self.retried += 1
        return block

    def _fits(self, nbytes: int) -> bool:
        return self.limit is None or self.reserved + nbytes <= self.limit

    def _new_segment(self, pool: _Pool, nbytes: int, page: int, tag: int | None,
                     request: int) -> _Segment:
        seg = _Segment(self._next_addr, pool, page > 0, page, tag, request)
        self._next_addr += nbytes
        self.segments[seg.base] = seg
        self.segments_created += 1
        return seg

    def _alloc_block(self, pool: _Pool, size: int, tag: int | None,
                     nbytes: int) -> Block | None:
        """alloc_block: a cudaMalloc of get_allocation_size's bytes, or (expandable
        segments) more pages mapped; None when over the line."""
        if self.config.expandable_segments:
            return self._alloc_expandable(pool, size, tag, nbytes)
        total = allocation_size(self.config, size)
        if not self._fits(total):
            return None
        seg = self._new_segment(pool, total, 0, tag, nbytes)
        seg.reserved = total
        self.reserved += total
        return Block(seg.base, total, seg)

    def _release_block(self, pool: _Pool, block: Block) -> None:
        """release_block: cudaFree of a whole cached segment."""
        pool.remove(block)
        del self.segments[block.seg.base]
        self.reserved -= block.size

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks (only with max_split_size): the smallest cached
        oversize block that covers the request, else oversize blocks largest first until
        their sum does; whether enough was released."""
        cap = self.config.max_split_size_bytes
        if cap is None or self.config.expandable_segments:
            return False
        key = max(size, cap)
        before = self.reserved
        i = pool.lower_bound(key)
        if i < len(pool.free):
            self._release_block(pool, pool.block(i))
            enough = True
        else:
            while pool.free and before - self.reserved < key and pool.block(-1).size >= cap:
                self._release_block(pool, pool.block(-1))
            enough = before - self.reserved >= key
        self.released += before - self.reserved
        return enough

    # ---- expandable segments ---------------------------------------------------------------
    def _alloc_expandable(self, pool: _Pool, size: int, tag: int | None,
                          nbytes: int) -> Block | None:
        """try_allocate_expandable_block: map the pages a free range of the stream's
        segment lacks (a new segment if it has none)."""
        block = self._find_expandable(pool, size, tag, nbytes)
        if not block.mapped and not self._map(pool, block, min(block.size, size)):
            return None
        while block.size < size:
            tail = block.next
            if tail is None or tail.allocated or tail.mapped:
                return None
            if not self._map(pool, tail, min(size - block.size, tail.size)):
                return None
            block = tail
        pool.remove(block)
        return block

    def _find_expandable(self, pool: _Pool, size: int, tag: int | None,
                         nbytes: int) -> Block:
        """find_expandable_block: the lowest unmapped range (with the free block before
        it) with room for ``size``, else a new segment's address space."""
        for addr in pool.unmapped:
            block = pool.unmapped_by_addr[addr]
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room, b = 0, block
            while room < size and b is not None and not b.allocated:
                room, b = room + b.size, b.next
            if room >= size:
                return block
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        seg = self._new_segment(pool, page * VIRTUAL_PAGES, page, tag, nbytes)
        block = Block(seg.base, page * VIRTUAL_PAGES, seg, mapped=False)
        pool.add_unmapped(block)
        return block

    def _map(self, pool: _Pool, block: Block, nbytes: int) -> bool:
        """map_block: whole pages from the block's start; the unmapped rest stays behind."""
        seg = block.seg
        first = (block.addr - seg.base) // seg.page
        mapped = (-(-(block.addr + nbytes - seg.base) // seg.page) - first) * seg.page
        if not self._fits(mapped):
            return False
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.addr + mapped, block.size - mapped, seg, mapped=False)
            _link(rest, block.next)
            _link(block, rest)
            pool.add_unmapped(rest)
            block.size = mapped
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add(block)
        seg.reserved += mapped
        self.reserved += mapped
        return True

    def _unmap(self, pool: _Pool, block: Block) -> None:
        """unmap_block: the whole pages inside a free block go back; a segment left with
        nothing mapped is released."""
        seg = block.seg
        start = seg.base + -(-(block.addr - seg.base) // seg.page) * seg.page
        stop = seg.base + (block.addr + block.size - seg.base) // seg.page * seg.page
        if start >= stop:
            return
        pool.remove(block)
        if start > block.addr:
            before = Block(block.addr, start - block.addr, seg)
            _link(block.prev, before)
            _link(before, block)
            pool.add(before)
        if stop < block.addr + block.size:
            after = Block(stop, block.addr + block.size - stop, seg)
            _link(after, block.next)
            _link(block, after)
            pool.add(after)
        block.addr, block.size, block.mapped = start, stop - start, False
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add_unmapped(block)
        seg.reserved -= stop - start
        self.reserved -= stop - start
        if not block.is_split:
            pool.remove_unmapped(block)
            del self.segments[seg.base]
