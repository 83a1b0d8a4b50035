"""``dflash patches pytorch-tests``' own logic, without torch or PyTorch's tests: the exact tree's
download (pinned sha256), outcomes from pytest's JUnit XML, the comparison, the verdicts of the
reruns alone, and a run resumed in its folder (pytest faked by a script that writes the reports)."""

from __future__ import annotations

import hashlib
import io
import json
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import replace

import pytest
from packaging.specifiers import SpecifierSet

from dflash.cli import main
from dflash.patching import series
from dflash.patchtools.pytorch_tests import environment, trees
from dflash.patchtools.pytorch_tests.outcomes import node_id, read_outcomes
from dflash.patchtools.pytorch_tests.resume import Setup, Side, outcome_environment, series_digest
from dflash.patchtools.pytorch_tests.runner import HUNG, Difference, FileRun, Runner, differences
from dflash.patchtools.pytorch_tests.selections import CI, FULL, Entry

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="6">
<testcase classname="dynamo.test_misc.MiscTests" name="test_ok" file="dynamo/test_misc.py" line="1" time="0.1"/>
<testcase classname="dynamo.test_misc.MiscTests" name="test_bad" file="dynamo/test_misc.py" line="2" time="0.1">
  <failure message="AssertionError: no">trace</failure></testcase>
<testcase classname="dynamo.test_misc.MiscTests" name="test_hangs" file="dynamo/test_misc.py" line="3" time="600">
  <failure message="Failed: Timeout &gt;600.0s">trace</failure></testcase>
<testcase classname="dynamo.test_misc.MiscTests" name="test_gpu[cuda]" file="dynamo/test_misc.py" line="4" time="0">
  <skipped message="no GPU"/></testcase>
<testcase classname="dynamo.test_misc.MiscTests" name="test_teardown" file="dynamo/test_misc.py" line="5" time="0.1"/>
<testcase classname="dynamo.test_misc.MiscTests" name="test_teardown" file="dynamo/test_misc.py" line="5" time="0.1">
  <error message="error in teardown">trace</error></testcase>
<testcase classname="test_module_level" name="test_plain_function" file="test_module_level.py" line="1" time="0.1"/>
</testsuite></testsuites>
"""


def test_outcomes_are_read_per_node_id_from_the_junit_report(tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text(JUNIT)
    assert read_outcomes(xml) == {
        "dynamo/test_misc.py::MiscTests::test_ok": "passed",
        "dynamo/test_misc.py::MiscTests::test_bad": "failed",
        "dynamo/test_misc.py::MiscTests::test_hangs": "timeout",
        "dynamo/test_misc.py::MiscTests::test_gpu[cuda]": "skipped",
        "dynamo/test_misc.py::MiscTests::test_teardown": "error",  # the worse of its two reports
        "test_module_level.py::test_plain_function": "passed",
    }


def test_node_ids_keep_nested_classes():
    assert node_id("export/test_export.py", "export.test_export.TestExport.Inner", "test_x") == (
        "export/test_export.py::TestExport::Inner::test_x"
    )


def _run(outcomes: dict[str, str], returncode: int | None = 1) -> FileRun:
    return FileRun(returncode, 1.0, outcomes, "log")


def test_differences_are_found_outcome_by_outcome():
    plain = _run({"f.py::A::test_1": "passed", "f.py::A::test_2": "failed", "f.py::A::test_3": "passed"})
    patched = _run({"f.py::A::test_1": "passed", "f.py::A::test_2": "passed", "f.py::A::test_4": "skipped"})
    found = differences(plain, patched, Entry("f.py"))
    assert [(d.node, d.plain, d.patched) for d in found] == [
        ("f.py::A::test_2", "failed", "passed"),
        ("f.py::A::test_3", "passed", "absent"),
        ("f.py::A::test_4", "absent", "skipped"),
    ]


def test_a_file_run_that_left_no_report_is_one_difference_unless_both_sides_did():
    crashed, fine = _run({}, returncode=-11), _run({"f.py::A::test_1": "passed"})
    (found,) = differences(fine, crashed, Entry("f.py"))
    assert (found.node, found.plain, found.patched) == ("f.py", "ran", "no report (exit -11)")
    assert differences(crashed, _run({}, returncode=-11), Entry("f.py")) == []
    (hung,) = differences(fine, _run({}, returncode=None), Entry("f.py"))
    assert hung.patched == HUNG and hung.verdict == "hang in the full run" and hung.counts


@pytest.mark.parametrize(
    ("alone", "verdict", "counts"),
    [
        (("passed", "failed"), "changes outcome", True),
        (("passed", "passed"), "same outcome alone (depends on order or load)", False),
        (("failed", "passed"), "differs alone too", True),
    ],
)
def test_a_difference_counts_when_it_holds_alone(alone, verdict, counts):
    difference = Difference("f.py::A::test", "passed", "failed", *alone)
    assert (difference.verdict, difference.counts) == (verdict, counts)


def test_a_timeout_in_the_full_run_counts_even_when_it_passes_alone():
    difference = Difference("f.py::A::test", "passed", "timeout", "passed", "passed")
    assert difference.verdict == "hang in the full run" and difference.counts


def test_entries_name_their_files_and_pytest_arguments():
    narrowed = Entry("functorch/test_aotdispatch.py", "not OpInfo")
    assert narrowed.pytest_args() == ["functorch/test_aotdispatch.py", "-k", "not OpInfo"]
    assert narrowed.slug.startswith("functorch__test_aotdispatch__k") and "/" not in narrowed.slug
    assert Entry("test_fx.py").slug == "test_fx"
    assert len({e.slug for e in FULL}) == len(FULL)  # no two entries write the same report
    assert {e.path for e in CI} <= {e.path for e in FULL}


def _tarball(top: str) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as archive:
        for name, text in ((f"{top}/test/conftest.py", b"# conftest\n"), (f"{top}/torch/__init__.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))
    return data.getvalue()


def _mirror(tmp_path, payload: bytes) -> str:
    pool = tmp_path / "mirror" / "pool" / "main" / "p" / "pytorch"
    pool.mkdir(parents=True)
    (pool / "pytorch_9.9.9.orig.tar.xz").write_bytes(payload)
    return (tmp_path / "mirror").as_uri()


def test_the_tree_is_fetched_once_and_only_its_test_folder_is_kept(tmp_path):
    payload = _tarball("pytorch-v9.9.9")
    tree = replace(
        trees.TREES["2.6.0"],
        tag="9.9.9",
        tarball="pytorch_9.9.9.orig.tar.xz",
        sha256=hashlib.sha256(payload).hexdigest(),
        top="pytorch-v9.9.9",
    )
    mirror = _mirror(tmp_path, payload)
    root = trees.fetch(tree, tmp_path / "cache", mirror)
    assert (root / "test" / "conftest.py").read_text() == "# conftest\n"
    assert not (root / "torch").exists()
    (tmp_path / "mirror" / "pool" / "main" / "p" / "pytorch" / "pytorch_9.9.9.orig.tar.xz").unlink()
    assert trees.fetch(tree, tmp_path / "cache", mirror) == root  # cached: no download


def test_a_tree_whose_sha256_is_not_the_pinned_one_is_refused(tmp_path):
    tree = replace(trees.TREES["2.6.0"], tag="9.9.9", tarball="pytorch_9.9.9.orig.tar.xz", sha256="0" * 64)
    with pytest.raises(ValueError, match="not the pinned"):
        trees.fetch(tree, tmp_path / "cache", _mirror(tmp_path, _tarball("pytorch-v9.9.9")))
    assert not (tmp_path / "cache" / "9.9.9" / "src").exists()


def test_an_unknown_tag_names_the_known_ones(capsys):
    with pytest.raises(ValueError, match="known tags are 2.6.0"):
        trees.tag_tree("2.99.0")


def test_k_without_a_file_is_a_usage_error(capsys):
    assert main(["patches", "pytorch-tests", "-k", "thread"]) == 2
    assert "-k narrows the --file entries" in capsys.readouterr().err


def test_list_prints_the_selection_without_running_anything(capsys):
    assert main(["patches", "pytorch-tests", "--selection", "ci", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [entry.label for entry in CI]


# pytest as the runner starts it (`-m pytest TARGET [-k EXPR] ... --junitxml=XML`, DFLASH_PATCHES naming
# the side, in test/): writes the outcomes plan.json gives TARGET's file on this side (TARGET a node id:
# that test's) and appends the call to `calls`. plan.json's "stop" [side, file, signal] cuts the run off
# there once: the file leaves a partial report, like pytest on Ctrl-C, then the runner gets the signal and
# the file exits 2. Its "hang" [side, file] sleeps past any file time limit; "deaf" does too, ignoring SIGTERM.
FAKE_PYTEST = """#!{python} -S
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[3:]
target, file = args[0], args[0].split("::")[0]
xml = Path(next(a for a in args if a.startswith("--junitxml=")).split("=", 1)[1])
side = "patched" if os.environ["DFLASH_PATCHES"] == "1" else "plain"
plan = json.loads(Path("plan.json").read_text())
with open("calls", "a") as calls:
    calls.write(side + " " + target + "\\n")
tests = plan["files"][file][side]
if "::" in target:
    tests = {{target.rsplit("::", 1)[1]: tests[target.rsplit("::", 1)[1]]}}
stop = plan.get("stop")
cut = stop is not None and stop[:2] == [side, file] and not Path("stopped").exists()
if cut:
    Path("stopped").touch()
    tests = dict(list(tests.items())[:1])
if plan.get("deaf") == [side, file]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path("deaf").touch()
if plan.get("hang") == [side, file] or plan.get("deaf") == [side, file]:
    time.sleep(60)
tags = {{"failed": "<failure message='no'/>", "skipped": "<skipped message='no'/>", "passed": ""}}
cases = "".join(
    f"<testcase classname='{{file[:-3]}}.T' name='{{name}}' file='{{file}}'>{{tags[o]}}</testcase>"
    for name, o in tests.items()
)
xml.write_text(f"<testsuites><testsuite>{{cases}}</testsuite></testsuites>")
if cut:  # the report first: a runner killed outright returns before an orphan would write it
    os.kill(os.getppid(), getattr(signal, stop[2]))
sys.exit(2 if cut else 1 if "failed" in tests.values() else 0)
"""
PLAN = {
    "a.py": {"plain": {"test_1": "passed", "test_2": "skipped"}, "patched": {"test_1": "passed", "test_2": "skipped"}},
    "b.py": {"plain": {"test_1": "passed", "test_2": "passed"}, "patched": {"test_1": "passed", "test_2": "failed"}},
    "c.py": {"plain": {"test_1": "passed"}, "patched": {"test_1": "passed"}},
}
# The CLI with the tree and the venv faked: fetch gives the fake tree, prepare the fake python.
DRIVER = """
import sys
from pathlib import Path
from dflash.patchtools.pytorch_tests import environment, trees
src, python = Path(sys.argv[1]), Path(sys.argv[2])
trees.fetch = lambda tree, cache, mirror=None: src
environment.prepare = lambda tree, src, cache, project: python
environment.torch_version = lambda python: "2.6.0+fake"
from dflash.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture
def fake_tree(tmp_path):
    """(the tree's root with test/plan.json, the fake python); plan.json holds PLAN without a stop."""
    src = tmp_path / "src"
    (src / "test").mkdir(parents=True)
    (src / "test" / "plan.json").write_text(json.dumps({"files": PLAN}))
    python = tmp_path / "python"
    python.write_text(FAKE_PYTEST.format(python=sys.executable))
    python.chmod(0o755)
    return src, python


def _args(tmp_path, out) -> list[str]:
    files = [arg for name in PLAN for arg in ("--file", name)]
    return ["patches", "pytorch-tests", "--tag", "2.6.0", *files, "--cache", str(tmp_path / "cache"), "--out", str(out)]


def _in_process(monkeypatch, fake_tree, args) -> int:
    src, python = fake_tree
    monkeypatch.setattr(trees, "fetch", lambda tree, cache, mirror=None: src)
    monkeypatch.setattr(environment, "prepare", lambda tree, src, cache, project: python)
    monkeypatch.setattr(environment, "torch_version", lambda python: "2.6.0+fake")
    return main(args)


def _cut_off(fake_tree, args, stop) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, cut off by ``stop`` ([side, file, signal]) while that file runs."""
    src, python = fake_tree
    plan = src / "test" / "plan.json"
    plan.write_text(json.dumps({"files": PLAN, "stop": stop}))
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(src), str(python), *args], capture_output=True, text=True, timeout=60
    )


def _calls(src) -> list[str]:
    """The pytest processes started since the last look."""
    calls = src / "test" / "calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return lines


def _results(out) -> list[dict]:
    """results.json's entries, its paths relative to ``out``, without the measured durations."""
    entries = json.loads((out / "results.json").read_text().replace(str(out), "OUT"))["entries"]
    for entry in entries:
        for side in ("plain", "patched"):
            del entry[side]["seconds"]
    return entries


def _tables(text: str, out) -> list[str]:
    return [
        line.replace(str(out), "OUT") for line in text.splitlines() if line.startswith("|") or "differences" in line
    ]


def test_a_run_killed_mid_file_resumes_in_its_folder_and_ends_as_an_uninterrupted_run(
    tmp_path, fake_tree, monkeypatch, capsys
):
    src, _ = fake_tree
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert _in_process(monkeypatch, fake_tree, _args(tmp_path, whole)) == 1  # b.py::T::test_2 changes outcome
    expected = capsys.readouterr().out
    assert "| `b.py::T::test_2` | passed | failed | passed | failed | changes outcome |" in expected
    _calls(src)

    killed = _cut_off(fake_tree, _args(tmp_path, resumed), ["patched", "b.py", "SIGKILL"])
    assert killed.returncode == -signal.SIGKILL
    assert _calls(src) == ["plain a.py", "patched a.py", "plain b.py", "patched b.py"]
    assert (resumed / "patched" / "b.xml").exists()  # its partial report, with no record of its end

    assert _in_process(monkeypatch, fake_tree, _args(tmp_path, resumed)) == 1
    printed = capsys.readouterr()
    assert _calls(src) == [
        "patched b.py",
        "plain c.py",
        "patched c.py",
        "plain b.py::T::test_2",
        "patched b.py::T::test_2",
    ]
    assert "running again, patched b.py: no record of its end (cut off mid-run" in printed.err
    assert "reused 3 of 6 file runs finished earlier in" in printed.err
    assert _tables(printed.out, resumed) == _tables(expected, whole)
    assert _results(resumed) == _results(whole)
    record = json.loads((resumed / "plain" / "a.json").read_text())
    reused = json.loads((resumed / "results.json").read_text())
    assert reused["entries"][0]["plain"]["seconds"] == round(record["seconds"], 1)  # the earlier run's
    assert reused["reused_file_runs"] == 3 and json.loads((whole / "results.json").read_text())["reused_file_runs"] == 0

    assert _in_process(monkeypatch, fake_tree, _args(tmp_path, resumed)) == 1  # all finished: nothing runs
    assert _calls(src) == [] and _tables(capsys.readouterr().out, resumed) == _tables(expected, whole)


def test_a_first_sigint_ends_the_run_at_once_and_keeps_no_record_of_the_file_it_cut_off(
    tmp_path, fake_tree, monkeypatch
):
    src, _ = fake_tree
    out = tmp_path / "out"
    stopped = _cut_off(fake_tree, _args(tmp_path, out), ["patched", "b.py", "SIGINT"])
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr
    assert _calls(src) == ["plain a.py", "patched a.py", "plain b.py", "patched b.py"]  # nothing after it
    assert f"the same command with --out {out} resumes" in stopped.stderr
    assert (out / "patched" / "b.xml").exists() and not (out / "patched" / "b.json").exists()
    assert _in_process(monkeypatch, fake_tree, _args(tmp_path, out)) == 1
    assert _calls(src)[0] == "patched b.py"


def _setup(**changes) -> Setup:
    return replace(Setup("1" * 64, "2.6.0+cu124", "2" * 64, "abc1234", {"OMP_NUM_THREADS": "1"}), **changes)


def _side(tmp_path, setup: Setup, *, patched: bool) -> Side:
    key = setup.key(["a.py", "--timeout=600"], 7200.0, patched=patched)
    return Side(tmp_path / "a.xml", tmp_path / "a.log", key, patched)


def test_a_record_is_reused_only_with_its_key_and_its_report(tmp_path):
    (tmp_path / "a.xml").write_text(JUNIT)
    _side(tmp_path, _setup(), patched=True).keep(1, 12.5, "abc1234")
    assert _side(tmp_path, _setup(commit="def5678"), patched=True).finished()["seconds"] == 12.5
    other = _side(tmp_path, _setup(series="3" * 64, torch="2.6.0+cpu"), patched=True).finished()
    assert other == (
        "recorded with other settings: torch 2.6.0+cu124 then, 2.6.0+cpu now; "
        "patch series as applied 222222222222 then, 333333333333 now"
    )
    (tmp_path / "a.xml").write_text(JUNIT.replace("test_ok", "test_other"))
    assert "is not the one its record names" in _side(tmp_path, _setup(), patched=True).finished()


def test_a_record_made_under_another_test_environment_is_not_reused(tmp_path):
    """CI=true, OMP_NUM_THREADS and PyTorch's PYTORCH_TEST_* switches change which tests run and how."""
    (tmp_path / "a.xml").write_text(JUNIT)
    _side(tmp_path, _setup(), patched=False).keep(0, 3.0, "abc1234")
    env = outcome_environment({"CI": "true", "OMP_NUM_THREADS": "1", "HOME": "/root", "PYTORCH_TEST_WITH_SLOW": "1"})
    assert env == {"CI": "true", "OMP_NUM_THREADS": "1", "PYTORCH_TEST_WITH_SLOW": "1"}
    assert _side(tmp_path, _setup(environment=env), patched=False).finished() == (
        "recorded with other settings: environment OMP_NUM_THREADS=1 then, "
        "CI=true OMP_NUM_THREADS=1 PYTORCH_TEST_WITH_SLOW=1 now"
    )


def test_plain_torch_runs_none_of_the_series_so_a_new_series_reruns_only_the_patched_side():
    old, new = _setup(), _setup(series="3" * 64)
    assert old.key(["a.py"], 1.0, patched=False) == new.key(["a.py"], 1.0, patched=False)
    assert old.key(["a.py"], 1.0, patched=True) != new.key(["a.py"], 1.0, patched=True)


def test_a_file_run_again_never_reads_the_report_it_replaces(tmp_path, fake_tree):
    src, python = fake_tree
    (src / "test" / "plan.json").write_text(json.dumps({"files": PLAN, "hang": ["plain", "a.py"]}))
    runner = Runner(python, src / "test", tmp_path / "out", 600, 0.5, _setup())
    side = runner.side(["a.py"], "a", patched=False)
    side.xml.parent.mkdir(parents=True)
    side.xml.write_text(JUNIT)  # an earlier run's, with another key
    side.keep(0, 1.0, "abc1234")
    run = runner.run(side)
    assert (run.problem, run.outcomes) == (HUNG, {})
    assert not side.record.exists()


def test_a_stopped_run_kills_a_pytest_that_ignores_sigterm_after_its_grace(tmp_path, fake_tree):
    src, python = fake_tree
    (src / "test" / "plan.json").write_text(json.dumps({"files": PLAN, "deaf": ["plain", "a.py"]}))
    runner = Runner(python, src / "test", tmp_path / "out", 600, 30.0, _setup())  # a file limit past the bound
    runner.stop_grace_s = 0.5
    side = runner.side(["a.py"], "a", patched=False)
    stopper = threading.Thread(target=lambda: _wait_for(src / "test" / "deaf") or runner.stop())
    stopper.start()
    started = time.monotonic()
    run = runner.run(side)
    stopper.join()
    assert time.monotonic() - started < 20, "the run waited on a process that ignores SIGTERM"
    assert run.returncode == -signal.SIGKILL


def _wait_for(path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _variant(name: str, versions: str, diff: str) -> series.Patch:
    return series.Patch(f"generated/{name}/{versions}.patch", name, {}, diff, SpecifierSet(versions))


def test_the_series_digest_covers_the_variants_a_release_applies_and_no_other(monkeypatch):
    def digest(diff_26: str, diff_27: str) -> str:
        variants = [_variant("c", ">=2.6,<2.7", diff_26), _variant("c", ">=2.7", diff_27)]
        monkeypatch.setattr(series, "concerns", lambda: {"c": variants})
        return series_digest("2.6.0")

    assert digest("x", "y") == digest("x", "z") != digest("w", "y")
