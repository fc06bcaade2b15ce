"""plan judges each row's CPU memory (ZeRO-Offload's, a DeepSpeed engine's) against the
host's memory as it judges the GPU peak against the GPU's: --host-memory, the GPU spec
file's host_memory_bytes, else this machine's RAM. A row over it does not fit, is not
chosen, and where it would have been chosen the notes say so and what fits instead.

The CPU memory is DeepSpeed's own estimator's (estimate_zero2_model_states_mem_needs,
tilefit.estimator.zero._host_bytes), derived here by hand for the tests' tiny MLP."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.hardware import get_device
from tilefit.models import load_workload
from tilefit.planner import Plan, PlanSearch, plan
from tilefit.planner.host import MACHINE, host_budget
from tilefit.planner.run import budget_of
from tilefit.recipe import Parallelism, Recipe
from tilefit.units import fmt_bytes

MLP = "tests.fixtures.tiny_models:mlp"
PSI = 32 * 64 + 64 + 64 * 10 + 10  # the MLP's parameters
# DeepSpeed's CPU estimate per node for ZeRO-2 on 2 GPUs (one node), buffer factor 1.5:
# offloaded, Psi x max(4 N, 16) with 16 bytes a parameter (fp32 master 4, fp32 gradients 4,
# AdamW's m and v 8); not offloaded, the fp32 copy each of the N processes loads, Psi x 4 x N
ZERO2_OFFLOAD_HOST = round(16 * PSI * 1.5)  # 66,288 B
ZERO2_HOST = round(4 * 2 * PSI * 1.5)  # 33,144 B


def _zero2(host: int | None) -> Plan:
    work = load_workload(MLP, input_shape=(32,))
    return plan(work, gpu="h100", global_batch=8, recipe=Recipe(parallel=Parallelism(2, "zero2")),
                search=PlanSearch(confirm=False, host_memory_bytes=host))


def test_zero_offload_over_the_host_does_not_fit_and_is_not_chosen() -> None:
    between = (ZERO2_HOST + ZERO2_OFFLOAD_HOST) // 2  # holds ZeRO-2, not its offload
    p = _zero2(between)
    host = {r.offload: r.host_memory_bytes for r in p.rows}
    assert host == {True: ZERO2_OFFLOAD_HOST, False: ZERO2_HOST}
    offloaded = [r for r in p.rows if r.offload]
    assert offloaded and all(r.fits_gpu and not r.fits_host and not r.fits for r in offloaded)
    assert all(r.fits for r in p.rows if not r.offload)
    assert p.best is not None and not p.best.offload
    assert p.host_budget is not None and p.host_budget.memory_bytes == between
    assert p.to_dict()["host_budget"] == {"bytes": between, "source": "given"}
    # a budget above the offload's keeps it: every row fits
    roomy = _zero2(ZERO2_OFFLOAD_HOST)
    assert all(r.fits for r in roomy.rows) and any(r.offload for r in roomy.rows)


def test_nothing_over_the_host_is_chosen_and_the_reason_says_why() -> None:
    p = _zero2(ZERO2_HOST - 1)  # one byte short of ZeRO-2's own copies
    assert p.best is None and not any(r.fits for r in p.rows)
    assert all(r.fits_gpu for r in p.rows)
    note = next(n for n in p.notes if "of CPU memory per node" in n)
    assert f"needs {fmt_bytes(ZERO2_HOST)} of CPU memory per node" in note
    assert (f"over the {fmt_bytes(ZERO2_HOST - 1)} of host memory given "
            "(PlanSearch(host_memory_bytes=...))") in note
    assert "DeepSpeed zero2 on 2 GPUs" in note and "no other plan fits" in note
    assert "fits the GPU, not the host's memory" in p.reason


def _tiny_gpu_plan(host: int) -> Plan:
    """The MLP on one GPU with 40,000 B for the step: AdamW on the GPU does not fit
    (its fp32 state alone is over), ZeRO-Offload does; Adafactor fits without offload."""
    h100 = get_device("h100")
    tiny = dataclasses.replace(h100, memory_bytes=40_000 + budget_of(h100, 1.0)[1])
    work = load_workload(MLP, input_shape=(32,))
    return plan(work, gpu=tiny, global_batch=8, search=PlanSearch(host_memory_bytes=host))


def test_one_gpu_offload_over_the_host_gives_way_to_what_fits_both() -> None:
    # ZeRO-Offload on one GPU, bf16 weights: DeepSpeed's 1.5 x (fp32 master 4 + fp32
    # gradients 4 bytes a parameter + AdamW's m and v in fp32), m and v being the traced
    # bf16 state widened to fp32; each of the 4 parameter tensors' bf16 state held in the
    # caching allocator's 512-byte blocks: 4096 + 512 + 1536 + 512 B, twice (m and v)
    def blocks(n: int) -> int:
        return -(-n * 2 // 512) * 512

    bf16_state = 2 * sum(blocks(n) for n in (32 * 64, 64, 64 * 10, 10))
    offload_host = int((8 * PSI + bf16_state * 4 // 2) * 1.5)
    fits = _tiny_gpu_plan(offload_host)
    assert fits.best is not None and fits.best.offload
    assert fits.best.host_memory_bytes == offload_host
    short = _tiny_gpu_plan(offload_host - 1)
    assert short.best is not None and not short.best.offload and short.best.fits
    assert short.best.changes_optimizer  # what fits both: another optimizer, on the GPU
    dropped = [r for r in short.rows if r.offload]
    assert dropped and all(r.fits_gpu and not r.fits for r in dropped)
    note = next(n for n in short.notes if n.startswith("ZeRO-Offload"))
    assert f"needs {fmt_bytes(offload_host)} of CPU memory per node" in note
    assert f"what fits both: {short.best.recipe_label()}" in note


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["plan", MLP, "--input-shape", "32", "--global-batch", "8",
                                 "--gpus", "2", "--strategy", "zero2", *args])
    return r.exit_code, r.output


def test_host_memory_flag_parses_and_the_report_shows_the_budget() -> None:
    code, out = _cli("--gpu", "h100", "--host-memory", "50000", "--json")
    assert code == 0, out
    data = json.loads(out[out.index("{"):])
    assert data["host_budget"] == {"bytes": 50_000, "source": "given"}
    rows = data["plans"]
    assert {r["fits_host"] for r in rows if r["offload"]} == {False}
    assert all(r["host_budget_bytes"] == 50_000 for r in rows)
    code, out = _cli("--gpu", "h100", "--host-memory", "0.5MiB")
    assert code == 0, out
    assert f"{fmt_bytes(ZERO2_HOST)} per node of the {fmt_bytes(2**19)} of host memory " \
        "given (--host-memory MEMORY)" in " ".join(out.split())


@pytest.mark.parametrize("bad", ["64XB", "lots", "0", "-5GiB"])
def test_a_bad_host_memory_is_a_clear_error_before_any_trace(bad: str) -> None:
    code, out = _cli("--gpu", "h100", "--host-memory", bad)
    assert code == 2 and "Traceback" not in out
    assert f"--host-memory {bad}" in out and "64GiB" in out
    with pytest.raises(TilefitError, match="host_memory_bytes"):
        PlanSearch(host_memory_bytes=0)


def test_the_spec_file_gives_the_training_machines_host_memory(tmp_path: Path) -> None:
    spec = tmp_path / "my-h100.toml"
    spec.write_text('base = "h100"\nname = "h100-64g-host"\nhost_memory_bytes = "64GiB"\n')
    assert get_device(str(spec)).host_memory_bytes == 64 * 2**30
    spec.write_text(f'base = "h100"\nhost_memory_bytes = {ZERO2_HOST}\n')
    code, out = _cli("--gpu", str(spec), "--json")
    assert code == 0, out
    data = json.loads(out[out.index("{"):])
    assert data["host_budget"] == {"bytes": ZERO2_HOST, "source": "spec file"}
    assert {r["offload"] for r in data["plans"] if r["fits"]} == {False}
    code, out = _cli("--gpu", str(spec), "--host-memory", "1GiB", "--json")  # the flag wins
    assert json.loads(out[out.index("{"):])["host_budget"]["bytes"] == 2**30
    spec.write_text('base = "h100"\nhost_memory_bytes = "a lot"\n')
    with pytest.raises(TilefitError, match="host_memory_bytes") as err:
        get_device(str(spec))
    assert str(spec) in str(err.value)


def test_by_default_the_host_is_this_machine() -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = host_budget(None, get_device("h100"))
    assert budget is not None and (budget.memory_bytes, budget.source) == (ram, MACHINE)
    assert "this machine's" in budget.words()
