"""A real allocator's recorded history (torch.cuda.memory._snapshot()'s device trace) as
replay events: hand-made traces whose segment layout follows from PyTorch's rules
(docs/references.md, section 31), and the private API's wrapper on a GPU."""

from __future__ import annotations

import pytest
import torch

from tilefit.estimator.allocator_history import events_of_history
from tilefit.estimator.allocator_replay import AllocEvent, replay

MIB = 2**20


def _trace(complete_b: bool) -> list[dict[str, object]]:
    """a (3 MiB) and b (4 MiB) share one 20 MiB large-pool segment (requests of 1-10 MiB
    get 20 MiB); both freed, the segment is one free 20 MiB block again, where c (15 MiB)
    fits. Without b's free_completed (b still owed to another stream) the free blocks are
    a's 3 MiB and the 13 MiB behind b: c needs its own segment, 16 MiB (a request of 10 MiB
    or more gets a segment of its size rounded up to 2 MiB): 36 MiB reserved."""
    out: list[dict[str, object]] = [
        {"action": "free_completed", "addr": 999, "size": 512, "stream": 0},  # before recording
        {"action": "segment_alloc", "addr": 100, "size": 20 * MIB, "stream": 0},
        {"action": "alloc", "addr": 100, "size": 3 * MIB, "stream": 0},
        {"action": "alloc", "addr": 100 + 3 * MIB, "size": 4 * MIB, "stream": 0},
        {"action": "free_requested", "addr": 100, "size": 3 * MIB, "stream": 0},
        {"action": "free_completed", "addr": 100, "size": 3 * MIB, "stream": 0},
        {"action": "free_requested", "addr": 100 + 3 * MIB, "size": 4 * MIB, "stream": 0},
    ]
    if complete_b:
        out.append({"action": "free_completed", "addr": 100 + 3 * MIB, "size": 4 * MIB,
                    "stream": 0})
    out.append({"action": "alloc", "addr": 100, "size": 15 * MIB, "stream": 0})
    return out


def test_a_recorded_trace_becomes_the_requests_in_order() -> None:
    events = events_of_history(_trace(complete_b=True))
    # the free of a block from before the recording and the segment events are left out;
    # a block's uid is its alloc's position in the trace
    assert events == [AllocEvent("alloc", 2, 3 * MIB, 2), AllocEvent("alloc", 3, 4 * MIB, 3),
                      AllocEvent("free", 2, 3 * MIB, 5), AllocEvent("free", 3, 4 * MIB, 7),
                      AllocEvent("alloc", 8, 15 * MIB, 8)]


def test_the_replay_of_a_recorded_trace_reserves_what_the_rules_say() -> None:
    assert replay(events_of_history(_trace(complete_b=True))).peak_reserved_bytes == 20 * MIB
    assert replay(events_of_history(_trace(complete_b=False))).peak_reserved_bytes == 36 * MIB


def test_streams_are_numbered_by_first_appearance() -> None:
    trace = [{"action": "alloc", "addr": 1, "size": 512, "stream": 94012},
             {"action": "alloc", "addr": 2, "size": 512, "stream": 0},
             {"action": "free_completed", "addr": 1, "size": 512, "stream": 94012}]
    assert [e.stream for e in events_of_history(trace)] == [0, 1, 0]


def test_the_private_history_api_the_wrapper_calls_is_torchs() -> None:
    # on a machine without CUDA: the functions tilefit.compat.cuda_memory calls exist in
    # this torch with the keywords it passes (a rename fails here, not on the day of a GPU)
    import inspect

    from torch.cuda import memory

    record = inspect.signature(memory._record_memory_history).parameters
    assert {"enabled", "context", "max_entries"} <= set(record)
    assert callable(memory._snapshot) and callable(memory._dump_snapshot)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_history_of_a_real_allocator_replays_to_its_reserved() -> None:
    from tilefit.compat.cuda_memory import allocator_history, record_allocator_history

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    record_allocator_history(True)
    try:
        a = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
        b = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        del a, b
        c = torch.empty(15 * MIB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        entries = allocator_history()
    finally:
        record_allocator_history(False)
    reserved = torch.cuda.memory_reserved() - before
    del c
    assert replay(events_of_history(entries)).peak_reserved_bytes == reserved == 20 * MIB


def _snapshot_file(tmp_path, complete_b: bool):  # type: ignore[no-untyped-def]
    import pickle

    data = {"segments": [{"device": 0, "total_size": 36 * MIB if not complete_b else 20 * MIB}],
            "device_traces": [_trace(complete_b)]}
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(data))
    return path


def test_cli_replays_a_snapshot_and_says_what_expandable_segments_would_hold(tmp_path) -> None:
    """b still owed to another stream: PyTorch's defaults reserve 36 MiB (above); with
    expandable segments the large pool is one segment mapped in 20 MiB pages (kLargeBuffer):
    a and b take the first page, c (15 MiB) fits in no free range (3 MiB before b, 13 MiB
    after it) and the segment grows at its end by one page: 40 MiB, more than the defaults'
    here, which the replay says."""
    import json

    from typer.testing import CliRunner

    from tilefit.cli.app import app

    r = CliRunner().invoke(app, ["snapshot", str(_snapshot_file(tmp_path, False)), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["requests"], d["frees_before_trace"], d["complete"]) == (3, 1, False)
    assert d["recorded_reserved_bytes"] == d["replayed_reserved_bytes"] == 36 * MIB
    assert d["alloc_conf"] == "expandable_segments:True"
    assert d["whatif_reserved_bytes"] == 40 * MIB
    text = CliRunner().invoke(app, ["snapshot", str(_snapshot_file(tmp_path, False))]).output
    assert "40.0 MiB" in text and "+11.1%" in text and "begins mid-run" in text


def test_a_snapshot_without_history_or_a_bad_file_is_a_clear_error(tmp_path) -> None:
    import pickle

    from typer.testing import CliRunner

    from tilefit.cli.app import app

    bare = tmp_path / "bare.pickle"
    bare.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    r = CliRunner().invoke(app, ["snapshot", str(bare)])
    assert r.exit_code == 2 and "_record_memory_history" in r.output
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"not a pickle")
    r = CliRunner().invoke(app, ["snapshot", str(junk)])
    assert r.exit_code == 2 and "cannot read the snapshot" in r.output
    r = CliRunner().invoke(app, ["snapshot", str(_snapshot_file(tmp_path, True)),
                                 "--alloc-conf", "expandable:True"])
    assert r.exit_code == 2 and "expandable_segments" in r.output


def test_a_snapshot_replayed_against_a_smaller_line_runs_out_where_the_rules_say(
        tmp_path) -> None:
    """The trace above without b's completed free needs 36 MiB under PyTorch's defaults:
    against 36 MiB it fits; against 30 MiB, c's new 16 MiB segment cannot be created and no
    segment is wholly free to release (a's 3 MiB sits in b's segment): out of memory at the
    third allocation, its 15 MiB."""
    import pickle

    from tilefit.estimator.allocator_history import replay_snapshot

    data = pickle.loads(_snapshot_file(tmp_path, False).read_bytes())
    roomy = replay_snapshot(data, "", limit_bytes=36 * MIB)
    assert roomy.fits and roomy.alloc_retries == 0
    tight = replay_snapshot(data, "", limit_bytes=30 * MIB)
    assert not tight.fits and (tight.failed_request, tight.failed_bytes) == (3, 15 * MIB)
    assert replay_snapshot(data, "").fits is None  # no line asked for


def test_cli_snapshot_on_a_named_gpu(tmp_path) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    r = CliRunner().invoke(app, ["snapshot", str(_snapshot_file(tmp_path, False)),
                                 "--gpu", "a100-80gb"])
    assert r.exit_code == 0 and "NVIDIA A100" in r.output and ": fits" in r.output
    r = CliRunner().invoke(app, ["snapshot", str(_snapshot_file(tmp_path, False)),
                                 "--gpu", "cpu"])
    assert r.exit_code == 2 and "--gpu rtx-4090" in r.output
