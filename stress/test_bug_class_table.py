"""The two-thread bug-class checks, plain and patched, for the end-of-run table."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from dflash.patchtools.verify.catalogue import BUG_CLASSES, applies_to
from dflash.patchtools.verify.runner import (
    TEST_SECONDS,
    all_checks_shared,
    all_checks_subprocess,
    reproduce_on_plain_torch,
)

TORCH_VERSION = version("torch")


@pytest.fixture(scope="module")
def results(tmp_path_factory, worker_id):
    if worker_id == "master":  # no xdist
        return all_checks_subprocess()
    return all_checks_shared(tmp_path_factory.getbasetemp().parent)  # one run for all workers


@pytest.mark.parametrize("bug_class", list(BUG_CLASSES))
def test_bug_class(bug_class, results, table_row):
    patched = results[(bug_class, True)]
    present = applies_to(bug_class, TORCH_VERSION)
    plain = results[(bug_class, False)]
    if present is True:
        plain = reproduce_on_plain_torch(bug_class, plain, seconds=TEST_SECONDS)
    plain_cell = f"{plain.failures} / {plain.calls}"
    if present is not True:
        plain_cell += f" (not present: {present.split(':')[0]})"  # the first clause; the skip gives it all
    table_row(f"class {bug_class}", bug_class, TORCH_VERSION, plain_cell, f"{patched.failures} / {patched.calls}", "-")
    assert patched.failures == 0, f"patched: {patched.failure_kinds}"
    if present is not True:
        pytest.skip(f"class {bug_class} not observable on torch {TORCH_VERSION}: {present}")
    assert plain.failures > 0, f"class {bug_class} did not reproduce on plain torch {TORCH_VERSION}"
