"""The generated variants against torch sources: they fit, they are current, coverage reports them.

The installed torch is always checked. Other releases come from ``DFLASH_TORCH_SOURCES`` (a folder
of ``<version>/torch/...`` trees made by ``scripts/fetch_torch_sources.py``; .ci/run fetches the
base releases of the source files). The refresh check needs those trees (skipped without them).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from dflash.patching.importhook import _module_path, patched_source, plan_all_or_none
from dflash.patching.plan import FAILED, torch_release
from dflash.patching.series import concerns, load_sources
from dflash.patchtools import refresh
from dflash.patchtools.coverage import collect, release_coverage

SOURCES = os.environ.get("DFLASH_TORCH_SOURCES")
TREES = [Path(torch.__file__).parent] + (
    sorted(p / "torch" for p in Path(SOURCES).iterdir() if (p / "torch" / "version.py").exists()) if SOURCES else []
)


@pytest.mark.parametrize("torch_dir", TREES, ids=lambda p: p.parent.name if p != TREES[0] else "installed")
def test_every_covered_release_fits(torch_dir):
    """Where coverage says a release fits (or is verified), every planned hunk applies and compiles there."""
    version = Version(torch_release(torch_dir)).base_version
    if release_coverage(str(version), None).state == "unsupported":
        pytest.skip(f"torch {version} is not covered by the series (see `dflash patches coverage`)")
    plan = plan_all_or_none(torch_dir, allow_unverified=True)
    assert set(plan.outcomes) == set(concerns())
    assert not [o for o in plan.outcomes.values() if o.state == FAILED]
    for module, patch_files in plan.module_patches.items():
        path = _module_path(torch_dir, module)
        compile(patched_source(module, path.read_text(encoding="utf-8"), patch_files), str(path), "exec")


def test_generated_variants_are_current():
    if not SOURCES:
        pytest.skip("DFLASH_TORCH_SOURCES not set: run scripts/fetch_torch_sources.py (CI does)")
    trees = refresh.release_trees(Path(SOURCES))
    missing = sorted({str(s.base_release) for s in load_sources()} - {str(r) for r in trees})
    assert not missing, f"fetch the base releases {missing} into {SOURCES}"
    problems = []
    for result in refresh.refresh_all(trees):
        problems += [result.problem] if result.problem else refresh.stale(result)
    assert not problems, "\n".join(problems) + "\nrun: dflash patches refresh --sources " + SOURCES


def test_installed_release_is_verified_with_matching_records():
    installed = Version(Version(torch.__version__).base_version)
    report = {c.version: c for c in collect()}
    assert report[str(installed)].state == "verified", report[str(installed)]
    assert report[str(installed)].records_match


def test_coverage_json_lists_releases_and_reports_dev_trees(tmp_path):
    # A development tree (2.16.0a0) is reported with dev=true; its state is not asserted on.
    dev = tmp_path / "2.16.0a0" / "torch"
    dev.parent.mkdir()
    subprocess.run(["cp", "-rs", str(Path(torch.__file__).parent), str(dev)], check=True)
    (dev / "version.py").unlink()
    (dev / "version.py").write_text("__version__ = '2.16.0a0+git1234'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dflash", "patches", "coverage", "--json", "--sources", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DFLASH_PATCHES": "0"},
    )
    assert proc.returncode == 0, proc.stderr
    releases = json.loads(proc.stdout)["releases"]
    assert all(set(r) == {"version", "state", "records_match", "reason", "dev", "installed"} for r in releases)
    assert [r["version"] for r in releases if r["installed"]] == [Version(torch.__version__).public]
    assert all(r["state"] in ("verified", "fits", "unsupported") for r in releases)
    assert all(r["reason"] for r in releases if r["state"] != "verified")
    versions = [r["version"] for r in releases]
    assert versions[0].startswith("2.5") and "2.16.0a0+git1234" in versions
    assert [r["dev"] for r in releases if r["version"] == "2.16.0a0+git1234"] == [True]
