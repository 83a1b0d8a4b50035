"""One regression test per torch race class A-K (see ``dflash.patchtools.verify``).

Each check runs in a fresh interpreter: with ``DFLASH_PATCHES=0`` (plain torch) it
must show failures wherever the installed torch version has the bug, and with the
dflash patch series applied it must show none. All runs start together, a CPU's
worth at a time, so the module takes about (runs x (startup + TEST_SECONDS)) / CPUs.
"""

from importlib.metadata import version

import pytest

from dflash.patchtools.verify.catalogue import BUG_CLASSES, applies_to
from dflash.patchtools.verify.runner import (
    TEST_SECONDS,
    all_checks_shared,
    all_checks_subprocess,
    reproduce_on_plain_torch,
    rerun_while_passing,
)

TORCH_VERSION = version("torch")


@pytest.fixture(scope="module")
def results(tmp_path_factory, worker_id):
    if worker_id == "master":  # no xdist
        return all_checks_subprocess()
    return all_checks_shared(tmp_path_factory.getbasetemp().parent)  # one run for all workers


@pytest.mark.parametrize("bug_class", list(BUG_CLASSES))
def test_plain_torch_shows_bug_class(bug_class, results):
    present = applies_to(bug_class, TORCH_VERSION)
    if present is not True:
        pytest.skip(f"class {bug_class} is not observable on plain torch {TORCH_VERSION}: {present}")
    result = reproduce_on_plain_torch(bug_class, results[(bug_class, False)], seconds=TEST_SECONDS)
    assert result.calls > 0, f"class {bug_class}: the check ran no operations"
    assert result.failures > 0, (
        f"class {bug_class} did not reproduce on plain torch {TORCH_VERSION} "
        f"({result.calls} calls): the check has lost its teeth"
    )


@pytest.mark.parametrize("bug_class", list(BUG_CLASSES))
def test_patched_torch_is_free_of_bug_class(bug_class, results):
    result = results[(bug_class, True)]
    assert result.calls > 0, f"class {bug_class}: the check ran no operations"
    assert result.failures == 0, (
        f"class {bug_class} with the dflash patches: {result.failures} / {result.calls} failed; "
        f"by kind {result.failure_kinds}; first: {result.example_error}"
    )


def test_rerun_while_passing_doubles_the_chances_until_a_failure():
    scales = []

    def rerun(scale: int) -> bool:  # "fails" (True) from scale 4 on
        scales.append(scale)
        return scale >= 4

    assert rerun_while_passing(False, rerun, bool, attempts=3) is True and scales == [2, 4]
    scales.clear()
    assert rerun_while_passing(False, rerun, bool, attempts=1) is False and scales == [2]
    scales.clear()
    assert rerun_while_passing(True, rerun, bool, attempts=3) is True and scales == []


def test_the_k_child_reports_an_exception_and_the_one_it_interrupted():
    from dflash.patchtools.verify.cold_start import _describe

    try:
        try:
            raise ImportError("cannot import name 'IndentedBuffer'")
        finally:
            raise AssertionError("Trying to pop empty mode stack")
    except AssertionError as exc:
        described = _describe(exc)
    assert described == (
        "AssertionError: Trying to pop empty mode stack <- ImportError: cannot import name 'IndentedBuffer'"
    )


def test_a_plain_crash_counts_as_the_race_and_a_patched_one_fails_the_run(monkeypatch):
    import subprocess

    from dflash.patchtools.verify import runner

    crashed = subprocess.CompletedProcess([], -11, stdout="", stderr="Fatal Python error: Segmentation fault")
    monkeypatch.setattr(runner, "run_watched", lambda cmd, **kwargs: crashed)
    result = runner.run_check_subprocess("B", patched=False, seconds=0.1)
    assert (result.calls, result.failures) == (1, 1) and "plain torch crashed: SIGSEGV" in result.example_error
    with pytest.raises(RuntimeError, match="exited with -11"):
        runner.run_check_subprocess("B", patched=True, seconds=0.1)


def test_the_workers_of_a_session_share_one_run_of_the_checks(tmp_path, monkeypatch):
    from dflash.patchtools.verify import runner
    from dflash.patchtools.verify.checks import CheckResult

    runs = []
    result = {("A", False): CheckResult(9, 3, "boom", {"boom": 3}), ("A", True): CheckResult(9, 0, series={"c": "on"})}
    monkeypatch.setattr(runner, "all_checks_subprocess", lambda seconds: runs.append(seconds) or result)
    assert runner.all_checks_shared(tmp_path, seconds=0.5) == result  # the first worker runs them
    assert runner.all_checks_shared(tmp_path, seconds=0.5) == result  # the next reads them
    assert runs == [0.5]
