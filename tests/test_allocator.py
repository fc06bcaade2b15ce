"""The caching allocator's model (tilefit.estimator.allocator) against layouts worked out by
hand from c10/cuda/CUDACachingAllocator.cpp (docs/references.md, section 31): every byte
value below is derived in the comment above it from the C++ rules, not read off the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tilefit
from tilefit.alloc_conf import (
    MIB,
    AllocatorConfig,
    alloc_conf_from_env,
    parse_alloc_conf,
    round_size,
)
from tilefit.errors import TilefitError
from tilefit.estimator import estimate_trace
from tilefit.estimator.allocator import Allocator
from tilefit.estimator.allocator_replay import AllocEvent, events_of, replay
from tilefit.hardware import get_device
from tilefit.recipe import Recipe
from tilefit.tracing.records import StorageRecord, Trace

KIB = 1024
DEFAULT = AllocatorConfig()


def _alloc(uid: int, nbytes: int) -> AllocEvent:
    return AllocEvent("alloc", uid, nbytes, uid)


def _free(uid: int, nbytes: int) -> AllocEvent:
    return AllocEvent("free", uid, nbytes, uid)


# ---- size rules -----------------------------------------------------------------------------
def test_sizes_round_to_512_bytes_and_to_power_of_two_divisions() -> None:
    # round_size: below kMinBlockSize a block is 512 B; else the next multiple of 512
    assert round_size(DEFAULT, 1) == 512
    assert round_size(DEFAULT, 1000) == 1024
    assert round_size(DEFAULT, 1200 * MIB + 1) == 1200 * MIB + 512
    # roundup_power2_divisions:4: 1200 MiB lies in [1024, 2048) MiB, cut at 1024, 1280,
    # 1536, 1792 MiB: 1280 MiB (the example of PyTorch's CUDA notes, in MiB)
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(four, 1200 * MIB) == 1280 * MIB
    assert round_size(four, 1024 * MIB) == 1024 * MIB  # a power of two stays
    # ...but only above kMinBlockSize * divisions = 2048 B: 1200 B rounds to 3 x 512
    assert round_size(four, 1200) == 1536


def test_the_interval_list_follows_the_code_not_the_notes() -> None:
    # parseRoundUpPower2Divisions: boundary 256 (MiB) sets interval log2(256) = 8, and
    # roundup_power2_divisions(size) reads interval log2(size) - 20: [256 MiB, 512 MiB) gets
    # 256's value (the notes say "2 divisions between 256MB and 512MB"); the first entry
    # also fills every interval below it; '>' every interval after the last one named
    cfg = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert round_size(cfg, 300 * MIB + 1) == 300 * MIB + 512  # 1 division: 512 B steps
    assert round_size(cfg, 600 * MIB) == 768 * MIB  # 2: 512 and 768 MiB
    assert round_size(cfg, 1200 * MIB) == 1280 * MIB  # 4: steps of 256 MiB
    assert round_size(cfg, 3000 * MIB) == 3072 * MIB  # 8 in [2048, 4096): steps of 256 MiB


# ---- segments, splitting, coalescing ----------------------------------------------------------
def test_small_requests_share_a_2_mib_segment() -> None:
    # 600 KiB <= kSmallSize: the small pool; get_allocation_size gives kSmallBuffer, 2 MiB;
    # should_split on the small pool splits any rest >= 512 B: 2048 - 600 = 1448 KiB free,
    # then 848 KiB, then 248 KiB. Three requests, one segment.
    a = Allocator(DEFAULT)
    blocks = [a.malloc(600 * KIB) for _ in range(3)]
    assert [b.size for b in blocks if b] == [600 * KIB] * 3
    assert (a.reserved, a.allocated, a.segments_created) == (2 * MIB, 1800 * KIB, 1)
    # a fourth does not fit the 248 KiB left: a second 2 MiB segment
    a.malloc(600 * KIB)
    assert (a.reserved, a.segments_created) == (4 * MIB, 2)


def test_a_mid_size_request_makes_a_20_mib_segment_the_next_one_splits() -> None:
    # 5 MiB is in (kSmallSize, kMinLargeAlloc): a kLargeBuffer segment, 20 MiB; the 15 MiB
    # rest is > kSmallSize so it is split off. 12 MiB: the best fit is that 15 MiB block,
    # split again (3 MiB rest > 1 MiB). One segment of 20 MiB, 17 MiB allocated.
    a = Allocator(DEFAULT)
    a.malloc(5 * MIB)
    a.malloc(12 * MIB)
    assert (a.reserved, a.allocated) == (20 * MIB, 17 * MIB)
    assert [s.size for s in a.segment_infos()] == [20 * MIB]
    # 2.5 MiB: the 3 MiB rest fits; its 0.5 MiB rest is not > 1 MiB, so the large pool
    # does not split it and the request holds the whole 3 MiB block (allocated counts it)
    a.malloc(5 * MIB // 2)
    assert (a.reserved, a.allocated) == (20 * MIB, 20 * MIB)


def test_a_freed_block_coalesces_with_its_free_neighbours() -> None:
    # one 2 MiB segment: A [0, 600K) B [600K, 1200K) C [1200K, 1800K), free [1800K, 2048K)
    a = Allocator(DEFAULT)
    first, middle, last = (a.malloc(600 * KIB) for _ in range(3))
    assert first and middle and last
    a.free(first)
    a.free(last)  # C joins the 248 KiB free after it: 848 KiB; A alone: 600 KiB
    assert a.empty_cache() == 0  # B still splits the segment: nothing to release
    a.malloc(800 * KIB)  # best fit: the coalesced 848 KiB (600 and 248 KiB are too small)
    assert (a.reserved, a.segments_created) == (2 * MIB, 1)
    a.free(middle)  # B joins A's 600 KiB: 1200 KiB free at the front
    a.malloc(1000 * KIB)  # fits only the coalesced 1200 KiB
    assert (a.reserved, a.segments_created) == (2 * MIB, 1)


def test_a_segment_whose_blocks_are_all_free_is_whole_again() -> None:
    # release_cached_blocks frees only unsplit segments: all three blocks freed, in any
    # order, merge back into one 2 MiB block and the whole segment goes back
    a = Allocator(DEFAULT)
    blocks = [a.malloc(600 * KIB) for _ in range(3)]
    for b in (blocks[1], blocks[0], blocks[2]):
        assert b is not None
        a.free(b)
    assert (a.empty_cache(), a.reserved) == (2 * MIB, 0)


def test_a_large_request_gets_an_exact_segment_that_max_split_size_keeps_whole() -> None:
    # 30 MiB >= kMinLargeAlloc: a segment of 30 MiB (a multiple of kRoundLarge, 2 MiB).
    # Freed and asked for 12 MiB: by default the cached 30 MiB block is split (18 MiB rest).
    a = Allocator(DEFAULT)
    big = a.malloc(30 * MIB)
    assert big is not None and a.reserved == 30 * MIB
    a.free(big)
    a.malloc(12 * MIB)
    assert (a.reserved, a.allocated) == (30 * MIB, 12 * MIB)
    # max_split_size_mb:20: the 30 MiB block is oversize and get_free_block refuses it to a
    # 12 MiB request: a new 12 MiB segment, 42 MiB reserved
    capped = Allocator(parse_alloc_conf("max_split_size_mb:20"))
    big = capped.malloc(30 * MIB)
    assert big is not None
    capped.free(big)
    capped.malloc(12 * MIB)
    assert (capped.reserved, capped.segments_created) == (42 * MIB, 2)


def test_an_oversize_block_serves_requests_within_max_non_split_rounding() -> None:
    # an oversize request (>= max_split_size) may take a cached block less than
    # max_non_split_rounding (20 MiB by default) larger, whole: 25 MiB takes the 30 MiB
    # block, unsplit (should_split: 25 MiB is not < max_split_size), allocated 30 MiB
    a = Allocator(parse_alloc_conf("max_split_size_mb:20"))
    big = a.malloc(30 * MIB)
    assert big is not None
    a.free(big)
    a.malloc(25 * MIB)
    assert (a.reserved, a.allocated) == (30 * MIB, 30 * MIB)
    # 50 MiB cached, 24 MiB asked: 50 >= 24 + 20, refused: a new 24 MiB segment
    b = Allocator(parse_alloc_conf("max_split_size_mb:20"))
    big = b.malloc(50 * MIB)
    assert big is not None
    b.free(big)
    b.malloc(24 * MIB)
    assert (b.reserved, b.allocated) == (74 * MIB, 24 * MIB)


# ---- expandable segments -------------------------------------------------------------------
def test_expandable_segments_reserve_the_mapped_pages() -> None:
    # expandable_segments:True: one segment per stream and pool, mapped in kLargeBuffer
    # (20 MiB) pages for the large pool. 5 MiB maps one page (20 MiB) and splits (any rest
    # >= 512 B); 12 MiB fits the 15 MiB rest. 30 MiB: the 3 MiB free block before the
    # unmapped pages plus 27 MiB more, two pages: 60 MiB mapped, one segment.
    # Without expandable segments: 20 MiB + an exact 30 MiB segment = 50 MiB, two segments.
    cfg = parse_alloc_conf("expandable_segments:True")
    events = [_alloc(0, 5 * MIB), _alloc(1, 12 * MIB), _alloc(2, 30 * MIB)]
    grown, plain = replay(events, cfg), replay(events, DEFAULT)
    assert (grown.peak_reserved_bytes, grown.segment_sizes) == (60 * MIB, (60 * MIB,))
    assert grown.segments[0].expandable and grown.allocated_at_peak_bytes == 47 * MIB
    assert (plain.peak_reserved_bytes, plain.segment_sizes) == (50 * MIB, (20 * MIB, 30 * MIB))
    # the small pool maps 2 MiB pages: four 600 KiB blocks need 2400 KiB, two pages
    small = replay([_alloc(i, 600 * KIB) for i in range(4)], cfg)
    assert (small.peak_reserved_bytes, small.n_segments) == (4 * MIB, 1)


def test_freed_expandable_pages_are_unmapped_by_a_cache_release() -> None:
    # 5 + 12 MiB in one 20 MiB page; both freed: one free 20 MiB block, unmapped whole
    a = Allocator(parse_alloc_conf("expandable_segments:True"))
    x, y = a.malloc(5 * MIB), a.malloc(12 * MIB)
    assert x and y
    a.free(x)
    assert a.empty_cache() == 0  # 5 MiB free in a page that y still uses
    a.free(y)
    assert (a.empty_cache(), a.reserved, a.segment_infos()) == (20 * MIB, 0, ())


def test_an_expandable_search_spares_the_block_before_the_unmapped_pages() -> None:
    # one 20 MiB page: x 4 MiB, y 2 MiB, z 11 MiB, 3 MiB free at the end; x freed. A 2.5
    # MiB request's best fit is the 3 MiB block, but get_free_block counts it as what it
    # can grow to (3 MiB + the unmapped pages) and moves on to the 4 MiB block, which can
    # grow less: it takes the front of the segment and leaves the 3 MiB block whole.
    a = Allocator(parse_alloc_conf("expandable_segments:True"))
    x, y, z = a.malloc(4 * MIB), a.malloc(2 * MIB), a.malloc(11 * MIB)
    assert x and y and z
    front = x.addr
    a.free(x)
    w = a.malloc(5 * MIB // 2)
    assert w is not None and w.addr == front
    # 3.5 MiB then fits neither 1.5 MiB (front) nor 3 MiB (end): the end block takes in
    # 0.5 MiB of a new page, 40 MiB mapped (plain best fit would have left 0.5 MiB at the
    # end and 4 MiB at the front, where 3.5 MiB fits: 20 MiB)
    a.malloc(7 * MIB // 2)
    assert (a.reserved, a.allocated) == (40 * MIB, 19 * MIB)


def test_a_stream_reuses_only_its_own_cached_blocks() -> None:
    # blocks are cached per stream: stream 1 cannot take stream 0's free 2 MiB segment
    a = Allocator(DEFAULT)
    first = a.malloc(600 * KIB, stream=0)
    assert first is not None
    a.free(first)
    a.malloc(600 * KIB, stream=1)
    assert (a.reserved, a.segments_created) == (4 * MIB, 2)
    assert (a.empty_cache(), a.reserved) == (2 * MIB, 2 * MIB)  # stream 0's goes back


# ---- the out-of-memory line ----------------------------------------------------------------
def test_releasing_the_cache_lets_a_step_fit_that_fails_without_it() -> None:
    # a 30 MiB segment, freed (cached), then a 600 KiB request: the small pool has no
    # block, so a 2 MiB segment: 32 MiB reserved. Against a 31 MiB line the cudaMalloc fails;
    # release_cached_blocks frees the unsplit 30 MiB segment and the retry succeeds.
    events = [_alloc(0, 30 * MIB), _free(0, 30 * MIB), _alloc(1, 600 * KIB)]
    free_run = replay(events)
    assert free_run.peak_reserved_bytes == 32 * MIB  # over the line without the release
    lined = replay(events, limit_bytes=31 * MIB)
    assert lined.fits and lined.failed is None
    assert (lined.peak_reserved_bytes, lined.final_reserved_bytes) == (30 * MIB, 2 * MIB)
    assert (lined.released_bytes, lined.retried_allocations) == (30 * MIB, 1)
    # the 30 MiB still in use: nothing to release, the step fails at the small request
    held = replay([_alloc(0, 30 * MIB), _alloc(1, 600 * KIB)], limit_bytes=31 * MIB)
    assert held.failed == _alloc(1, 600 * KIB) and not held.fits
    assert (held.peak_reserved_bytes, held.released_bytes) == (30 * MIB, 0)


def test_oversize_blocks_are_released_first_and_only_as_many_as_needed() -> None:
    # max_split_size_mb:20; cached oversize blocks of 30 and 70 MiB (100 MiB reserved), a
    # 45 MiB request: 70 >= 45 + 20 is refused; a 46 MiB segment (2 MiB rounding) needs 146
    # MiB > 120 MiB. release_available_cached_blocks frees the smallest oversize block of at
    # least 45 MiB, the 70 MiB one, and the retry fits (76 MiB); the 30 MiB block stays.
    cfg = parse_alloc_conf("max_split_size_mb:20")
    events = [_alloc(0, 30 * MIB), _alloc(1, 70 * MIB), _free(0, 30 * MIB), _free(1, 70 * MIB),
              _alloc(2, 45 * MIB)]
    out = replay(events, cfg, limit_bytes=120 * MIB)
    assert out.fits and (out.final_reserved_bytes, out.released_bytes) == (76 * MIB, 70 * MIB)


# ---- PYTORCH_CUDA_ALLOC_CONF ---------------------------------------------------------------
def test_the_configuration_parses_as_pytorch_reads_it() -> None:
    cfg = parse_alloc_conf(" max_split_size_mb: 128 ,expandable_segments:True,"
                           "garbage_collection_threshold:0.6,backend:native")
    assert cfg.max_split_size_bytes == 128 * MIB and cfg.expandable_segments
    assert cfg.unmodelled == ("garbage_collection_threshold", "backend")
    assert "garbage_collection_threshold" in cfg.notes[0]
    # large_segment_size_mb is read first: it moves the smallest max_split_size_mb allowed
    # and max_non_split_rounding's default
    big = parse_alloc_conf("max_split_size_mb:30,large_segment_size_mb:30")
    assert (big.large_segment_size_bytes, big.max_non_split_rounding_bytes) == (30 * MIB,) * 2
    assert alloc_conf_from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) \
        .expandable_segments
    assert alloc_conf_from_env({}) == DEFAULT


@pytest.mark.parametrize(("text", "named"), [
    ("max_split_mb:128", "max_split_mb"),  # unknown key
    ("max_split_size_mb:10", "max_split_size_mb"),  # below large_segment_size (20 MiB)
    ("max_split_size_mb:12x", "max_split_size_mb"),
    ("expandable_segments:true", "expandable_segments"),  # PyTorch takes True/False only
    ("roundup_power2_divisions:3", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[300:2]", "roundup_power2_divisions"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
    ("backend:magic", "backend"),
    ("large_segment_size_mb:8", "large_segment_size_mb"),
    ("max_split_size_mb", "max_split_size_mb"),  # no value
])
def test_a_bad_configuration_names_the_key(text: str, named: str) -> None:
    with pytest.raises(TilefitError) as err:
        parse_alloc_conf(text)
    assert named in str(err.value)


def test_an_unknown_key_lists_the_accepted_ones() -> None:
    with pytest.raises(TilefitError) as err:
        parse_alloc_conf("expandable_segment:True")
    assert "expandable_segments" in str(err.value) and "max_split_size_mb" in str(err.value)


# ---- a real trace ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def linear_trace() -> Trace:
    return tilefit.trace(lambda: torch.nn.Linear(64, 64), torch.zeros(8, 64),
                         loss_fn=lambda m, b: m(b).sum(), gpu="a100-80gb",
                         recipe=Recipe(precision="fp32"))


def test_events_come_in_the_order_the_step_made_them(linear_trace: Trace) -> None:
    # at one index: frees of older storages, the op's allocations, then its own storages
    # that died at once; storages alive before the trace first
    def s(uid: int, alloc_at: int, free_at: int | None) -> StorageRecord:
        return StorageRecord(uid, 1024, alloc_at, free_at, "temporaries", "forward", "")
    tr = dataclasses.replace(linear_trace, storages=(
        s(3, 2, None), s(2, 2, 2), s(1, 0, 2), s(0, -1, None)))
    assert [(e.kind, e.uid) for e in events_of(tr)] == [
        ("alloc", 0), ("alloc", 1), ("free", 1), ("alloc", 2), ("alloc", 3), ("free", 2)]


def test_a_real_trace_replays_to_the_estimates_allocated_peak(
        linear_trace: Trace) -> None:
    # every storage of this step is <= 1 MiB: the small pool splits to the 512-byte block,
    # so the allocator's allocated peak is the estimate's (512-byte rounded) timeline peak
    est = estimate_trace(linear_trace, get_device("a100-80gb"))
    out = replay(events_of(linear_trace))
    assert out.peak_allocated_bytes == est.peak_memory_bytes
    assert out.peak_reserved_bytes >= out.peak_allocated_bytes
    assert out.peak_reserved_bytes == 2 * MIB * out.n_segments  # small segments only
    assert out.fits and out.segments_created >= out.n_segments
