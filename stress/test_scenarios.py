"""Property tests: every schedule of every scenario runs with no failure, plus each scenario's teeth.

Regression schedules: paste the minimal ``Schedule(...)`` hypothesis prints into
``REGRESSIONS[scenario]``; they run before any random draw.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from hypothesis import assume, example, given

from dflash.patching.startup import env_disabled
from dflash.patchtools.verify.catalogue import applies_to
from dflash.patchtools.verify.runner import rerun_while_passing
from dflash.watchdog import run_watched

from .runner import run_schedule, unsupported
from .scenarios import SCENARIOS
from .strategies import MaskSpec, Schedule, Step

REGRESSIONS: dict[str, tuple[Schedule, ...]] = {name: () for name in SCENARIOS}
TEETH_EXAMPLES = 6
TEETH_RETRIES = 2
#: A teeth run's watchdog, per schedule (600 s for 6 schedules, as the run's limit was before).
TEETH_SECONDS_PER_EXAMPLE = 100.0
TORCH_VERSION = version("torch")
_ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_schedules_hold(scenario, device, stress_run, table_row):
    run, failing = [0], set()  # failing: distinct schedules (hypothesis replays one while it shrinks)

    def holds(schedule: Schedule) -> None:
        assume(unsupported(schedule, device) is None)
        failures = run_schedule(schedule, device)
        run[0] += 1
        if failures:
            failing.add(repr(schedule))
        assert not failures, "\n".join(failures)

    prop = given(SCENARIOS[scenario].schedules)(holds)
    for regression in REGRESSIONS[scenario]:
        prop = example(regression)(prop)
    try:
        stress_run(prop)
    finally:
        cell = f"{len(failing)} / {run[0]}"
        plain, patched = (cell, "-") if env_disabled() else ("-", cell)
        table_row(
            f"{scenario} on {device}",
            ",".join(SCENARIOS[scenario].bug_classes),
            TORCH_VERSION,
            plain,
            patched,
            str(run[0]),
        )


def _teeth_run(scenario: str, patched: bool, examples: int = TEETH_EXAMPLES) -> dict:
    """The runner's JSON result; a hang raises :class:`dflash.watchdog.Hang` with every thread's stack."""
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    cmd = [sys.executable, "-m", "stress.runner", scenario, "--examples", str(examples), "--json"]
    proc = run_watched(cmd, seconds=TEETH_SECONDS_PER_EXAMPLE * examples, env=env, cwd=_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip(), f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "requested": examples}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_teeth(scenario, table_row):
    """The same derandomized schedules fail on plain torch and pass patched, each in a fresh interpreter."""
    targets = SCENARIOS[scenario].bug_classes
    present = [c for c in targets if applies_to(c, TORCH_VERSION) is True]
    plain = _teeth_run(scenario, patched=False)
    if present:  # while no schedule fails, twice as many: the derandomized first ones again, and new ones
        plain = rerun_while_passing(
            plain,
            lambda scale: _teeth_run(scenario, patched=False, examples=TEETH_EXAMPLES * scale),
            lambda result: result["failing"] > 0,
            attempts=TEETH_RETRIES,
        )
    patched = _teeth_run(scenario, patched=True, examples=plain["requested"])
    table_row(
        scenario,
        ",".join(targets),
        TORCH_VERSION,
        f"{plain['failing']} / {plain['examples']}" if present else f"{plain['failing']} (no target class present)",
        f"{patched['failing']} / {patched['examples']}",
        str(plain["examples"] + patched["examples"]),
    )
    assert patched["failing"] == 0, (
        f"patched: {patched['failing']} failing schedules; first: {patched['example_failure']}"
    )
    if not present:
        pytest.skip(f"none of {targets} is present in torch {TORCH_VERSION}: nothing to reproduce on plain torch")
    assert plain["failing"] > 0, f"plain torch {TORCH_VERSION} passed all {plain['examples']} schedules: no teeth"


@pytest.mark.parametrize(
    "dtype,device,action,skipped",
    [
        ("float64", "cuda", "flex_attention", True),
        ("float32", "cuda", "flex_attention", False),
        ("float64", "cpu", "flex_attention", False),
        ("float64", "cuda", "eager_flex_attention", True),
        ("float64", "cuda", "warm_call", False),
    ],
)
def test_only_cuda_float64_flex_is_unsupported(dtype, device, action, skipped):
    mask = MaskSpec(kind="causal", block_size=2, start_offset=0, window=1, context_len=32, anchors=(1,))
    schedule = Schedule(threads=((Step(action, 1),), (Step(action, 1),)), dtype=dtype, dynamic=None, mask=mask)
    assert (unsupported(schedule, device) is not None) is skipped
