"""Options, profiles, devices and the plain-vs-patched summary table of the stress suite.

``--stress-profile=default`` (bounded examples, a few minutes on 2 CPU cores) or
``soak`` (repeats each property with fresh random schedules for ``--stress-seconds``).
Failing schedules shrink; hypothesis prints the minimal one and stores it in
``stress/.hypothesis/`` so the next run replays it first.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_ROW = "stress_table_row"
_HEADER = ("scenario / class", "targets", "torch", "plain failures", "patched failures", "examples run")

settings.register_profile(
    "stress-default",
    max_examples=8,
    deadline=None,
    print_blob=True,
    database=DirectoryBasedExampleDatabase(str(Path(__file__).parent / ".hypothesis" / "examples")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("stress-soak", settings.get_profile("stress-default"), max_examples=50)


def pytest_addoption(parser):
    group = parser.getgroup("stress")
    group.addoption("--stress-profile", choices=("default", "soak"), default="default")
    group.addoption(
        "--stress-seconds",
        type=float,
        default=300.0,
        help="soak: seconds each property keeps drawing (default %(default)s)",
    )


def pytest_configure(config):
    settings.load_profile(f"stress-{config.getoption('--stress-profile')}")


def _devices() -> list[str]:
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        # One GPU per xdist worker: gw0 -> cuda:0, gw1 -> cuda:1, ...
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        devices.append(f"cuda:{int(worker.removeprefix('gw')) % torch.cuda.device_count()}")
    return devices


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """CPU always; the worker's own GPU when there is one."""
    from .runner import warm_imports

    matching = [d for d in _devices() if d.startswith(request.param)]
    if not matching:
        pytest.skip("no CUDA device")
    warm_imports(matching[0])
    return matching[0]


@pytest.fixture
def stress_run(request):
    """Run a @given property under the profile's settings, once (default profile) or again and again
    for --stress-seconds (soak)."""
    profile = request.config.getoption("--stress-profile")
    # Applied to the property itself: hypothesis's active profile is process-wide, and whatever else
    # ran in this xdist worker may have changed it (its examples per property would change with it).
    profile_settings = settings.get_profile(f"stress-{profile}")

    def run(prop) -> None:
        prop = profile_settings(prop)
        if profile != "soak":
            prop()
            return
        deadline = time.monotonic() + request.config.getoption("--stress-seconds")
        while time.monotonic() < deadline:
            prop()

    return run


@pytest.fixture
def table_row(record_property):
    """Record one row of the end-of-run table (works under xdist: user properties travel)."""

    def record(name: str, targets: str, torch_version: str, plain: str, patched: str, examples: str) -> None:
        record_property(_ROW, json.dumps([name, targets, torch_version, plain, patched, examples]))

    return record


def pytest_terminal_summary(terminalreporter):
    rows = [
        json.loads(value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for key, value in getattr(report, "user_properties", ())
        if key == _ROW
    ]
    if not rows:
        return
    rows.sort()
    widths = [max(len(str(row[i])) for row in [_HEADER, *rows]) for i in range(len(_HEADER))]
    terminalreporter.section("plain torch (DFLASH_PATCHES=0) vs patched (classes, teeth: fresh interpreters)")
    for row in [_HEADER, *rows]:
        terminalreporter.write_line("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
