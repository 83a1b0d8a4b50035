"""Each test's outcome from the JUnit XML pytest writes (``-o junit_family=xunit1``: cases name their file)."""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
TIMEOUT = "timeout"  # pytest-timeout failed it: a hang


def read_outcomes(xml: Path) -> dict[str, str]:
    """``{pytest node id: outcome}`` of every test case in ``xml`` (an xfail counts as skipped, as pytest
    reports it there; a failure of pytest-timeout is :data:`TIMEOUT`). A case reported twice (an error
    in teardown after a result) keeps the worse outcome.

    Raises:
        FileNotFoundError, ElementTree.ParseError: no or no complete report (the process died first).
    """
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(xml).iter("testcase"):
        node = node_id(case.get("file") or "", case.get("classname") or "", case.get("name") or "")
        outcome = _outcome(case)
        outcomes[node] = _worse(outcomes[node], outcome) if node in outcomes else outcome
    return outcomes


def node_id(file: str, classname: str, name: str) -> str:
    """pytest's node id of a case: ``dynamo/test_misc.py`` + ``dynamo.test_misc.MiscTests`` + ``test_x``
    -> ``dynamo/test_misc.py::MiscTests::test_x`` (a module-level test has no class part)."""
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
    return "::".join(part for part in (file, *inner.split("."), name) if part)


def _outcome(case: ElementTree.Element) -> str:
    failure = case.find("failure")
    if failure is not None:
        return TIMEOUT if "Timeout >" in (failure.get("message") or "") else FAILED
    if case.find("error") is not None:
        return ERROR
    if case.find("skipped") is not None:
        return SKIPPED
    return PASSED


def _worse(first: str, second: str) -> str:
    rank = (TIMEOUT, ERROR, FAILED, PASSED, SKIPPED)  # what a case reported twice ends as
    return min(first, second, key=rank.index)
