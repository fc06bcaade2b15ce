"""The host/device timelines (tilefit.estimator.timeline), checked by hand arithmetic."""

from __future__ import annotations

import pytest

from tilefit.estimator.timeline import Block, Item, simulate


def test_device_bound_ops_overlap_the_host():
    # host 1, device 2, three times: issued 1, 2, 3; done 3, 5, 7
    t = simulate([Block((Item(1.0, 2.0),) * 3)])
    assert t.step_time_s == 7.0 and t.device_s == 6.0 and t.host_s == 3.0
    assert t.device_idle_s == 1.0  # the device waits for the first issue only


def test_host_bound_ops_starve_the_device():
    # host 2, device 1: issued 2, 4, 6; done 3, 5, 7 -> the device idles 4 of 7
    t = simulate([Block((Item(2.0, 1.0),) * 3)])
    assert t.step_time_s == 7.0
    assert t.host_bound_fraction == pytest.approx(4 / 7)


def test_a_sync_makes_the_host_wait():
    # item 1: issued 1, done 11, then the host waits until 11; item 2: issued 12, done 13
    t = simulate([Block((Item(1.0, 10.0, sync=True), Item(1.0, 1.0)))])
    assert t.step_time_s == 13.0
    # without the sync the second op's issue overlaps the first's run: done 12
    assert simulate([Block((Item(1.0, 10.0), Item(1.0, 1.0)))]).step_time_s == 12.0


@pytest.mark.parametrize("repeats", [1, 2, 3, 4, 7, 50])
@pytest.mark.parametrize("items", [
    (Item(1.0, 2.0), Item(3.0, 0.5)),
    (Item(2.0, 1.0, sync=True), Item(0.5, 4.0)),
    (Item(0.1, 0.2), Item(0.1, 5.0), Item(4.0, 0.1)),
])
def test_repeated_blocks_extrapolate_exactly(repeats: int, items: tuple[Item, ...]) -> None:
    # a block repeated n times equals the same items written out n times
    repeated = simulate([Block((Item(0.3, 0.7),)), Block(items, repeats)])
    written = simulate([Block((Item(0.3, 0.7),)), Block(items * repeats)])
    assert repeated.step_time_s == pytest.approx(written.step_time_s)
    assert repeated.device_s == pytest.approx(written.device_s)
