"""Every test of `pytest tests stress` runs under a watchdog that needs no GIL (:mod:`dflash.watchdog`):
a test that makes no progress for ``--hang-seconds`` prints every thread's stack and ends the test
process (a hang is a failure, never a timeout to rerun), and every child process the test starts
(bug-class checks, stress runners, scripts) gets its own watchdog with a shorter time, so the hung
process is the one whose stacks are printed."""

from __future__ import annotations

import os

import pytest

from dflash import watchdog


def pytest_addoption(parser):
    parser.addoption(
        "--hang-seconds",
        type=float,
        default=1200.0,
        help="a test (setup, call and teardown) that runs longer prints every thread's stack and fails the run "
        "(default %(default)s; a stress soak needs its --stress-seconds and more)",
    )


def pytest_configure(config):
    # The terminal's stderr, not the capture file of the test running when the watchdog fires (that
    # file is lost with the process); pytest has stopped capturing while plugins configure.
    config.watchdog_stderr = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = item.config.getoption("--hang-seconds")
    before = os.environ.get(watchdog.ENV)
    os.environ[watchdog.ENV] = f"{seconds * watchdog.CHILD_SHARE:.1f}"
    try:
        with watchdog.watching(seconds, file=item.config.watchdog_stderr):
            yield
    finally:
        if before is None:
            del os.environ[watchdog.ENV]
        else:
            os.environ[watchdog.ENV] = before
