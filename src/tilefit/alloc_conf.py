"""PYTORCH_CUDA_ALLOC_CONF as PyTorch's CUDA caching allocator reads it, and the allocator's
size rules that depend on it (docs/references.md, section 31).

The constants and rules are PyTorch's (c10/core/AllocatorConfig.h and .cpp, c10/cuda/
CUDAAllocatorConfig.h, c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.13); the parser accepts
exactly the keys a CUDA build of PyTorch accepts and refuses the rest as PyTorch does. Keys it
accepts without modelling their effect are named in ``AllocatorConfig.notes``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tilefit.errors import TilefitError, close_matches

__all__ = ["ACCEPTED_KEYS", "K_LARGE_BUFFER", "K_MIN_BLOCK_SIZE", "K_MIN_LARGE_ALLOC",
           "K_ROUND_LARGE", "K_SMALL_BUFFER", "K_SMALL_SIZE", "MIB", "AllocatorConfig",
           "alloc_conf_from_env", "allocation_size", "parse_alloc_conf", "round_size"]

MIB = 1 << 20
# c10/core/AllocatorConfig.h (older versions: CUDACachingAllocator.cpp)
K_MIN_BLOCK_SIZE = 512  # every block is a multiple of 512 bytes
K_SMALL_SIZE = MIB  # the largest request of the small pool
K_SMALL_BUFFER = 2 * MIB  # the small pool's segments (and its expandable segments' pages)
K_MIN_LARGE_ALLOC = 10 * MIB  # requests in (1 MiB, 10 MiB) get a large_segment_size segment
K_ROUND_LARGE = 2 * MIB  # larger requests get their own segment, rounded to 2 MiB
K_LARGE_BUFFER = 20 * MIB  # large_segment_size's default; the large expandable pages
# roundup_power2_divisions holds one value per power-of-two interval from 1 MiB to 64 GiB
# (c10/core/AllocatorConfig.cpp: kRoundUpPowerOfTwoIntervals, kRoundUpPowerOfTwoStart)
N_INTERVALS = 16
FIRST_INTERVAL_LOG2 = 20
MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads

# the keys of AcceleratorAllocatorConfig (c10/core/AllocatorConfig.cpp, getMutableKeys) and
# of CUDAAllocatorConfig (c10/cuda/CUDAAllocatorConfig.h, getKeys)
MODELLED = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
            "roundup_power2_divisions", "expandable_segments")
NOT_MODELLED = {
    "garbage_collection_threshold": "acts only under a per-process memory fraction "
                                    "(set_per_process_memory_fraction), frees by block age",
    "backend": "cudaMallocAsync hands allocation to CUDA's own pool allocator",
    "per_process_memory_fraction": "the replay's limit_bytes plays its part",
    "release_lock_on_cudamalloc": "a locking detail, no effect on the layout",
    "release_lock_on_hipmalloc": "ROCm",
    "pinned_use_cuda_host_register": "pinned host memory",
    "pinned_use_hip_host_register": "pinned host memory (ROCm)",
    "pinned_num_register_threads": "pinned host memory",
    "pinned_use_background_threads": "pinned host memory",
    "pinned_reserve_segment_size_mb": "pinned host memory",
    "pinned_max_round_threshold_mb": "pinned host memory",
    "pinned_max_cached_size_mb": "pinned host memory",
    "pinned_free_catch_all": "pinned host memory",
    "graph_capture_record_stream_reuse": "CUDA graph capture",
    "throw_on_cudamalloc_oom": "raises earlier, the same line",
}
ACCEPTED_KEYS = (*MODELLED, *NOT_MODELLED)
BOOL_KEYS = ("expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
             "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
             "pinned_use_background_threads", "pinned_free_catch_all",
             "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom")


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings; the defaults are PyTorch's with no
    PYTORCH_CUDA_ALLOC_CONF."""

    max_split_size_bytes: int | None = None  # None: unlimited, every block may be split
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    large_segment_size_bytes: int = K_LARGE_BUFFER
    # per power-of-two interval from 1 MiB (index 0: below 2 MiB) to 32 GiB and above
    # (index 15); 0 or 1: plain 512-byte rounding
    roundup_power2_divisions: tuple[int, ...] = (0,) * N_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    backend: str = "native"
    text: str = ""  # the setting as given
    unmodelled: tuple[str, ...] = field(default=())  # accepted keys the replay ignores

    def divisions(self, size: int) -> int:
        """The power-of-two divisions for a request of ``size`` bytes (AllocatorConfig.cpp,
        roundup_power2_divisions(size))."""
        index = max(size.bit_length() - 1 - FIRST_INTERVAL_LOG2, 0)
        return self.roundup_power2_divisions[min(index, N_INTERVALS - 1)]

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per accepted key the replay does not model."""
        return tuple(f"PYTORCH_CUDA_ALLOC_CONF {k}: accepted, not modelled ({NOT_MODELLED[k]})"
                     for k in self.unmodelled)


def round_size(config: AllocatorConfig, size: int) -> int:
    """A request's block size (CUDACachingAllocator.cpp, round_size): 512-byte multiples, or
    the next power-of-two division where roundup_power2_divisions asks for one."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _next_power2_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _next_power2_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: the interval [2^k, 2^(k+1)) holding ``size`` cut into
    ``divisions`` equal steps, and the first step at or above ``size``."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return -(-size // step) * step


def allocation_size(config: AllocatorConfig, size: int) -> int:
    """The segment cudaMalloc'ed for a block of ``size`` bytes no cached block holds
    (CUDACachingAllocator.cpp, get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size_bytes
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def alloc_conf_from_env(environ: Mapping[str, str]) -> AllocatorConfig:
    """The configuration a CUDA build reads from ``environ``: PYTORCH_CUDA_ALLOC_CONF, else
    PYTORCH_ALLOC_CONF (CUDAAllocatorConfig::instance)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in environ:
            return parse_alloc_conf(environ[name])
    return AllocatorConfig()


# ---- parsing ------------------------------------------------------------------------------
def _tokens(text: str) -> list[str]:
    """ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own, whitespace is dropped."""
    out, word = [], ""
    for ch in text:
        if ch in ",:[]":
            if word:
                out.append(word)
            out.append(ch)
            word = ""
        elif not ch.isspace():
            word += ch
    return [*out, word] if word else out


def _bad(key: str, value: str, expected: str) -> TilefitError:
    return TilefitError(f"PYTORCH_CUDA_ALLOC_CONF: bad value for {key}", expected=expected,
                        given=repr(value), fix=f"set {key} to {expected}")


def _int(key: str, value: str, expected: str = "a whole number") -> int:
    if not value.isdigit():
        raise _bad(key, value, expected)
    return int(value)


def _power_of_two(key: str, value: str, *, zero: bool = False) -> int:
    expected = "0 or a power of two" if zero else "a power of two"
    n = _int(key, value, expected)
    if (n == 0 and not zero) or n & (n - 1):
        raise _bad(key, value, expected)
    return n


def _float(key: str, value: str, low: float, high: float, *, closed: bool) -> float:
    expected = f"a number in ({low}, {high}{']' if closed else ')'}"
    try:
        x = float(value)
    except ValueError:
        raise _bad(key, value, expected) from None
    if not (low < x <= high if closed else low < x < high):
        raise _bad(key, value, expected)
    return x


def _divisions_list(items: list[str]) -> tuple[int, ...]:
    """The list form, [256:1,512:2,>:8]: a boundary in MiB (a power of two) sets the
    interval starting there, the first also every interval below it; '>' every interval
    after the last one named (AllocatorConfig.cpp, parseRoundUpPower2Divisions)."""
    key = "roundup_power2_divisions"
    out, last, first = [0] * N_INTERVALS, 0, True
    for item in items:
        boundary, sep, value = item.partition(":")
        if not sep:
            raise _bad(key, item, "interval:divisions pairs such as [256:1,512:2,>:8]")
        n = _power_of_two(key, value, zero=True)
        if boundary == ">":
            out[last + 1:] = [n] * (N_INTERVALS - last - 1)
            continue
        index = min(_power_of_two(key, boundary).bit_length() - 1, N_INTERVALS - 1)
        if first:
            out[:index] = [n] * index
            first = False
        out[index], last = n, index
    return tuple(out)


def _pairs(text: str) -> list[tuple[str, str]]:
    """(key, value) pairs; a list value keeps its items joined by ',' inside '[...]'."""
    toks, pairs, i = _tokens(text), [], 0
    while i < len(toks):
        key = toks[i]
        if toks[i + 1:i + 2] != [":"] or i + 2 >= len(toks):
            raise TilefitError(f"PYTORCH_CUDA_ALLOC_CONF: no value for {key!r}",
                               expected="key:value pairs separated by ','", given=repr(text))
        if toks[i + 2] == "[":
            if "]" not in toks[i + 2:]:
                raise _bad(key, "".join(toks[i + 2:]), "a list closed by ']'")
            end = toks.index("]", i + 2)
            value, i = "".join(toks[i + 2:end + 1]), end + 1
        else:
            value, i = toks[i + 2], i + 3
        if value in (",", ":", "]"):
            raise _bad(key, value, "a value")
        pairs.append((key, value))
        if i < len(toks):
            if toks[i] != ",":
                raise _bad(key, value + toks[i], "key:value pairs separated by ','")
            i += 1
    return pairs


def _check_key(key: str) -> None:
    if key not in ACCEPTED_KEYS:
        raise TilefitError(
            f"PYTORCH_CUDA_ALLOC_CONF: unrecognized key {key!r} (PyTorch refuses it too)",
            expected="one of " + ", ".join(sorted(ACCEPTED_KEYS)), given=repr(key),
            fix=_spelling_fix(key))


def _spelling_fix(key: str) -> str:
    close = close_matches(key, sorted(ACCEPTED_KEYS), n=2)
    return (f"did you mean {' or '.join(close)}? " if close else "") + \
        "remove it or correct its spelling"


def _modelled(cfg: AllocatorConfig, key: str, value: str) -> AllocatorConfig:
    segment_mb = cfg.large_segment_size_bytes // MIB
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        n = _int(key, value, f"a whole number of MiB >= {segment_mb}")
        if n < segment_mb:
            raise _bad(key, value, f"a whole number of MiB >= {segment_mb}")
        name = "max_split_size_bytes" if key == "max_split_size_mb" \
            else "max_non_split_rounding_bytes"
        return replace(cfg, **{name: n * MIB})
    if key == "roundup_power2_divisions":
        if value.startswith("["):
            items = [t for t in value[1:-1].split(",") if t]
            return replace(cfg, roundup_power2_divisions=_divisions_list(items))
        n = _power_of_two(key, value)
        return replace(cfg, roundup_power2_divisions=(n,) * N_INTERVALS)
    if key == "expandable_segments":
        return replace(cfg, expandable_segments=_bool(key, value))
    return cfg  # large_segment_size_mb: read in a first pass


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):
        raise _bad(key, value, "True or False (PyTorch takes no other spelling)")
    return value == "True"


def _unmodelled(cfg: AllocatorConfig, key: str, value: str) -> AllocatorConfig:
    if key in BOOL_KEYS:
        _bool(key, value)
    elif key == "backend":
        if value not in ("native", "cudaMallocAsync"):
            raise _bad(key, value, "native or cudaMallocAsync")
        cfg = replace(cfg, backend=value)
    elif key == "garbage_collection_threshold":
        cfg = replace(cfg, garbage_collection_threshold=_float(key, value, 0.0, 1.0,
                                                               closed=False))
    elif key == "per_process_memory_fraction":
        _float(key, value, 0.0, 1.0, closed=True)
    elif key == "pinned_num_register_threads":
        if _power_of_two(key, value) > MAX_REGISTER_THREADS:
            raise _bad(key, value, f"a power of two <= {MAX_REGISTER_THREADS}")
    elif key == "pinned_reserve_segment_size_mb":
        if _int(key, value, "a whole number of MiB > 0") == 0:
            raise _bad(key, value, "a whole number of MiB > 0")
    else:  # pinned_max_round_threshold_mb, pinned_max_cached_size_mb
        _int(key, value, "a whole number of MiB")
    names = (*cfg.unmodelled, key) if key not in cfg.unmodelled else cfg.unmodelled
    return replace(cfg, unmodelled=names)


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """PYTORCH_CUDA_ALLOC_CONF's value as an AllocatorConfig: ``key:value`` pairs separated
    by ',', a later key overriding an earlier one, large_segment_size_mb read first (the
    other sizes are checked against it). An unknown key or a malformed value is a
    TilefitError naming it and what is accepted."""
    pairs = _pairs(text)
    cfg = AllocatorConfig(text=text)
    for key, value in pairs:
        _check_key(key)
        if key == "large_segment_size_mb":
            mb = _int(key, value, "a whole number of MiB > 10")
            if mb <= K_MIN_LARGE_ALLOC // MIB:
                raise _bad(key, value, "a whole number of MiB > 10")
            cfg = replace(cfg, large_segment_size_bytes=mb * MIB,
                          max_non_split_rounding_bytes=mb * MIB)
    for key, value in pairs:
        cfg = _modelled(cfg, key, value) if key in MODELLED else _unmodelled(cfg, key, value)
    return cfg
