"""``dflash patches upstream``: the pull-request kit, made for a tree of the torch 2.15.0 sources.

The tree is laid out like a PyTorch checkout (``torch/...`` at the root plus
``version.txt``), holding the files the series touches, committed in a temporary
git repository. The sources come from ``DFLASH_TORCH_SOURCES/2.15.0`` (made by
``scripts/fetch_torch_sources.py``, as CI does).
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.patching.series import load_series
from dflash.patchtools.upstream import PRESENT, REBASED, UpstreamKitError, make_kit, tree_release

SOURCES = os.environ.get("DFLASH_TORCH_SOURCES")


def _git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def _init_repo(path: Path) -> None:
    _git(path, "init", "-q")
    _git(path, "config", "user.name", "Kit Tester")
    _git(path, "config", "user.email", "kit@example.com")
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "base")


@pytest.fixture
def tree(tmp_path) -> Path:
    source = Path(SOURCES or "/nonexistent") / "2.15.0"
    if not (source / "torch" / "version.py").exists():
        pytest.skip("torch 2.15.0 sources missing: set DFLASH_TORCH_SOURCES (scripts/fetch_torch_sources.py)")
    root = tmp_path / "pytorch"
    for path in {f.path for patch in load_series() for f in patch.files}:
        if (source / path).exists():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / path, root / path)
    (root / "version.txt").write_text("2.15.0\n")
    _init_repo(root)
    return root


def _clone(tree: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(tree), str(dest)], check=True)
    _git(dest, "config", "user.name", "Kit Tester")
    _git(dest, "config", "user.email", "kit@example.com")
    return dest


def test_kit_rebases_the_series_onto_a_2_15_tree(tree, tmp_path, capsys):
    head = _git(tree, "rev-parse", "HEAD")
    assert main(["patches", "upstream", "--pytorch-src", str(tree), "--out", str(tmp_path / "kit")]) == 0
    printed = capsys.readouterr().out
    assert "fx-tracing-flag-thread-local" in printed and "upstream" in printed
    patches = sorted((tmp_path / "kit" / "patches").glob("*.patch"))
    assert len(patches) >= 3
    # The checkout itself is untouched.
    assert _git(tree, "rev-parse", "HEAD") == head and _git(tree, "status", "--porcelain") == ""

    applied = _clone(tree, tmp_path / "apply")
    for patch in patches:
        _git(applied, "apply", "--check", str(patch))
        _git(applied, "apply", str(patch))

    stacked = _clone(tree, tmp_path / "am")
    # --keep-non-patch: keep "[dynamo]" in the subject (plain `git am` strips every leading [...]).
    _git(stacked, "am", "-q", "--keep-non-patch", *map(str, patches))
    subjects = _git(stacked, "log", "--format=%s", f"{head.strip()}..HEAD").splitlines()[::-1]
    assert len(subjects) == len(patches)
    assert all(s.startswith(("[fx] ", "[dynamo] ")) for s in subjects), subjects
    assert _git(applied, "diff", "HEAD", "--stat") != ""
    # git am of the stack and git apply of each patch give the same tree.
    for path in _git(stacked, "ls-files").split():
        assert (stacked / path).read_bytes() == (applied / path).read_bytes(), path

    for patch in patches:
        text = patch.read_text()
        assert text.startswith("From ") and "\nDate: " in text and "\nSubject: [PATCH " in text
        assert "\nTest plan:\npython test/" in text
        assert re.search(r"\n(Fixes|Part of|See also) #\d+\n", text), patch.name
        assert "\nnew file mode 100644\n" in text and "/test_thread_safety_" in text
    for test_file in _git(stacked, "ls-files", "test").split():
        compile((stacked / test_file).read_text(), test_file, "exec")

    description = (tmp_path / "kit" / "PR_DESCRIPTION.md").read_text()
    for section in ("## Problem", "## Reproducer", "## Fix", "## Why the lock is off the hot path", "## Benchmark"):
        assert section in description
    assert "Not measured." in description
    assert "#118260" in description and "#126024" in description


def test_kit_detects_fixes_already_in_the_tree(tree, tmp_path):
    make_kit(tree, tmp_path / "kit")
    patches = sorted((tmp_path / "kit" / "patches").glob("*.patch"))
    _git(tree, "am", "-q", *map(str, patches))
    reports = make_kit(tree, tmp_path / "again")
    assert not [r for r in reports if r.state == REBASED]
    assert len([r for r in reports if r.state == PRESENT]) == len(patches)
    assert not (tmp_path / "again" / "patches").exists()


def test_benchmark_numbers_come_from_the_json(tree, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "torch": "2.13.0+cpu",
                "backend": "eager",
                "calls_per_s_1_threads": {
                    "plain": 51234.0,
                    "patched": 50987.0,
                    "ratio": 0.9952,
                    "ratio_ci95": [0.9901, 0.9987],
                },
                "calls_per_s_4_threads": {"plain": 60111.0, "patched": 59876.0, "ratio": 0.9961},
            }
        )
    )
    make_kit(tree, tmp_path / "kit", benchmark_json=bench)
    description = (tmp_path / "kit" / "PR_DESCRIPTION.md").read_text()
    assert "| 1 | 51,234 | 50,987 | 0.995 (95% CI 0.990 to 0.999) |" in description
    assert "| 4 | 60,111 | 59,876 | 0.996 |" in description  # JSON from before the interval was added
    assert "Not measured." not in description
    bench.write_text(json.dumps({"torch": "2.13.0"}))
    with pytest.raises(UpstreamKitError, match="no calls_per_s_<N>_threads entries"):
        make_kit(tree, tmp_path / "kit2", benchmark_json=bench)


def test_tree_release_reads_version_txt_or_version_py(tmp_path):
    (tmp_path / "torch").mkdir()
    with pytest.raises(UpstreamKitError, match="no version.txt nor torch/version.py"):
        tree_release(tmp_path)
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.16.0a0+git1234'\n")
    assert tree_release(tmp_path) == "2.16.0a0+git1234"
    (tmp_path / "version.txt").write_text("2.16.0a0\n")
    assert tree_release(tmp_path) == "2.16.0a0"


def test_bad_trees_are_named(tmp_path):
    with pytest.raises(UpstreamKitError, match="no torch/ folder"):
        make_kit(tmp_path, tmp_path / "kit")
    (tmp_path / "torch").mkdir()
    (tmp_path / "version.txt").write_text("2.16.0a0\n")
    with pytest.raises(UpstreamKitError, match="git rev-parse"):
        make_kit(tmp_path, tmp_path / "kit")
