"""Run a commit's tests against the tree's torch without and with the commit, each in a fresh process.

A PyTorch checkout built in place (``torch/_C*.so`` present) is its own torch; a source-only tree
(e.g. the Python files of a release wheel in git) borrows the compiled parts of an interpreter's
installed torch. Either way each state of the stack is laid out as a *shadow* folder: the touched
files written as they are in that state, every other entry a symlink to the base torch (or to the
tree's ``test/``), so no copy of torch is made. The runs import ``torch`` from the shadow folder
with any startup hook that patches torch switched off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from pathlib import Path

# Any `.pth` startup hook of the interpreter that patches torch at import must stay off: the runs test
# the tree's files as they are.
PLAIN_ENV = {"DFLASH_PATCHES": "0", "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
RUN_TIMEOUT_S = 900

# Runs the named test classes of one test file and prints one JSON line of outcomes. Loaded like
# `python test/x/test_y.py` (its folder first on sys.path) so sibling imports resolve as in CI.
DRIVER = r"""
import importlib.util, json, os, sys, unittest
path, classes = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
sys.argv = [path]
outcomes = {}
try:
    spec = importlib.util.spec_from_file_location("kit_test_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kit_test_module"] = module
    spec.loader.exec_module(module)
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(getattr(module, c)) for c in classes)

    class Result(unittest.TestResult):
        def _put(self, test, outcome, detail=""):
            outcomes[test.id().split(".", 1)[1]] = [outcome, detail[-1500:]]
        def addSuccess(self, test): self._put(test, "pass")
        def addFailure(self, test, err): self._put(test, "fail", self._exc_info_to_string(err, test))
        def addError(self, test, err): self._put(test, "error", self._exc_info_to_string(err, test))
        def addSkip(self, test, reason): self._put(test, "skip", reason)
        def addExpectedFailure(self, test, err): self._put(test, "pass")
        def addUnexpectedSuccess(self, test): self._put(test, "fail", "unexpected success")

    suite.run(Result())
    import torch
    print("KIT-RESULT " + json.dumps({"torch": torch.__file__, "outcomes": outcomes}), flush=True)
except BaseException as e:
    import traceback
    print("KIT-RESULT " + json.dumps({"error": traceback.format_exc()[-3000:], "outcomes": outcomes}), flush=True)
os._exit(0)  # a test thread left hanging must not keep the process alive
"""


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Outcomes of one fresh-process run: test id -> (``pass``/``fail``/``error``/``skip``, detail);
    ``error`` is set when the file could not be imported or the process died."""

    outcomes: dict[str, tuple[str, str]]
    error: str = ""


def base_torch(src: Path, python: str) -> tuple[Path, str]:
    """(torch package folder, how it was found): the tree's own when built in place, else the interpreter's.

    Raises:
        RuntimeError: the interpreter cannot import torch (its message).
    """
    if any((src / "torch").glob("_C*.so")) or any((src / "torch").glob("_C*.pyd")):
        return src / "torch", "the tree's own build"
    proc = subprocess.run(
        [python, "-c", "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **PLAIN_ENV},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{python} cannot import torch: {proc.stderr.strip()[-500:]}")
    folder, version = proc.stdout.split()[-2:]
    return Path(folder), f"the compiled parts of an installed torch build (`{version}`) under the tree's Python files"


def _shadow(base: Path, overlay: dict[str, str], dest: Path) -> None:
    """``dest`` mirrors ``base`` by symlinks, with ``overlay`` (relative path -> text) as real files."""
    dest.mkdir(parents=True, exist_ok=True)
    heads = {p.split("/", 1)[0]: p for p in overlay}
    entries = {e.name for e in base.iterdir()} if base.is_dir() else set()
    for name in entries | set(heads):
        inner = {p.split("/", 1)[1]: t for p, t in overlay.items() if "/" in p and p.split("/", 1)[0] == name}
        if name in overlay:
            (dest / name).write_bytes(overlay[name].encode("utf-8"))
        elif inner:
            _shadow(base / name, inner, dest / name)
        elif name != "__pycache__":
            (dest / name).symlink_to(base / name)


def lay_out(state: dict[str, str], torch_dir: Path, tree_test_dir: Path, dest: Path) -> Path:
    """A runnable root for one state of the stack: ``dest/torch`` and ``dest/test`` shadows."""
    torch_files = {p.removeprefix("torch/"): t for p, t in state.items() if p.startswith("torch/")}
    test_files = {p.removeprefix("test/"): t for p, t in state.items() if p.startswith("test/")}
    _shadow(torch_dir, torch_files, dest / "torch")
    _shadow(tree_test_dir, test_files, dest / "test")
    return dest


def run_tests(python: str, root: Path, test_file: str, classes: list[str]) -> RunResult:
    """Run ``classes`` of ``root/test_file`` in a fresh ``python`` whose ``import torch`` is ``root/torch``."""
    env = {**os.environ, **PLAIN_ENV, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory() as scratch:  # a run never writes into the tree or the cwd
        try:
            proc = subprocess.run(
                [python, "-c", DRIVER, str(root / test_file), *classes],
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return RunResult({}, f"timed out after {RUN_TIMEOUT_S} s")
    line = next((ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("KIT-RESULT ")), None)
    if line is None:
        return RunResult({}, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-1500:]}")
    data = json.loads(line.removeprefix("KIT-RESULT "))
    if "torch" in data and not data["torch"].startswith(str(root)):
        return RunResult({}, f"imported torch from {data['torch']}, not from the laid-out tree")
    return RunResult({k: tuple(v) for k, v in data["outcomes"].items()}, data.get("error", ""))
