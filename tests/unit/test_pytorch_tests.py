"""``dflash patches pytorch-tests``' own logic, without torch or PyTorch's tests: the exact tree's
download (pinned sha256), outcomes from pytest's JUnit XML, the comparison, and the verdicts of the
reruns alone."""

from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import replace

import pytest

from dflash.cli import main
from dflash.patchtools.pytorch_tests import trees
from dflash.patchtools.pytorch_tests.outcomes import node_id, read_outcomes
from dflash.patchtools.pytorch_tests.runner import HUNG, Difference, FileRun, differences
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
