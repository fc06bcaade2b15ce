"""The network between nodes (tilefit.hardware.networks): --nodes and --network, checked by
hand against NCCL's ring formula (docs/references.md, section 20)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.estimator.collectives import collective_time_s, link_description
from tilefit.hardware import get_device
from tilefit.hardware.networks import get_network, on_nodes


def test_an_all_reduce_across_nodes_runs_at_the_named_network() -> None:
    # 16 H100s as 2 nodes of 8 on InfiniBand HDR: 200 Gb/s = 25 GB/s per GPU, under NVLink 4's
    # 450 GB/s one way, times NCCL's 0.8; ring all-reduce moves 2(n-1)/n of the bytes; 30 us
    # across nodes
    dev = on_nodes(get_device("h100-sxm"), 16, 2, get_network("ib-hdr"))
    assert dev.gpus_per_node == 8 and dev.network_bytes_per_s == 25e9
    nbytes = 1 << 30
    assert collective_time_s("all_reduce", nbytes, 16, dev) == pytest.approx(
        30e-6 + 2 * 15 / 16 * nbytes / (25e9 * 0.8))
    # one node of 16 (--nodes 1): NVLink only, 15 us
    one = on_nodes(get_device("h100-sxm"), 16, 1)
    assert collective_time_s("all_reduce", nbytes, 16, one) == pytest.approx(
        15e-6 + 2 * 15 / 16 * nbytes / (450e9 * 0.8))
    assert "25 Gb/s" not in link_description(dev, 16)
    assert link_description(dev, 16) == ("NVLink 4 within nodes of 8, 200 Gb/s per GPU "
                                         "between 2 nodes")
    assert link_description(one, 16) == "NVLink 4"


def test_a_spec_file_gives_the_line_rate_per_gpu(tmp_path) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text('name = "lab-eth"\ngbit_per_s = 100\n')
    net = get_network(str(spec))
    assert net.bytes_per_s == 12.5e9 and net.name == "lab-eth"
    bad = tmp_path / "bad.toml"
    bad.write_text("gbit_per_s = 0\n")
    with pytest.raises(TilefitError, match="gbit_per_s"):
        get_network(str(bad))


def test_nodes_must_divide_the_gpus_and_unknown_networks_say_the_format() -> None:
    with pytest.raises(TilefitError) as err:
        on_nodes(get_device("h100-sxm"), 16, 3)
    assert "1, 2, 4, 8, 16" in str(err.value) and "on_nodes(..., nodes=2)" in str(err.value)
    with pytest.raises(TilefitError) as err:
        get_network("infiniband-9000")
    assert "ib-ndr" in str(err.value) and "gbit_per_s" in str(err.value)


def test_the_cli_refuses_bad_node_options_with_exit_2() -> None:
    runner = CliRunner()
    for args in (["--gpus", "16", "--network", "nope"], ["--nodes", "2"],
                 ["--gpus", "16", "--nodes", "5"]):
        result = runner.invoke(app, ["estimate", "gpt2", "--gpu", "h100", *args])
        assert result.exit_code == 2, (args, result.output)
