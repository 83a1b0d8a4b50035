"""Every concern of the series applies (or is upstream) on each torch release we have sources for.

The installed torch is always checked. Other releases come from
``DFLASH_TORCH_SOURCES`` (a folder of ``<version>/torch/...`` trees made by
``scripts/fetch_torch_sources.py``; .ci/run fetches 2.11.0, 2.14.1 and 2.15.0).
"""

import os
from pathlib import Path

import pytest
import torch

from dflash.patching.importhook import patched_source
from dflash.patching.plan import FAILED, PENDING, make_plan
from dflash.patching.series import concerns

SOURCES = os.environ.get("DFLASH_TORCH_SOURCES")
TREES = [Path(torch.__file__).parent] + (
    sorted(p / "torch" for p in Path(SOURCES).iterdir() if (p / "torch" / "version.py").exists()) if SOURCES else []
)


@pytest.mark.parametrize("torch_dir", TREES, ids=lambda p: p.parent.name if p != TREES[0] else "installed")
def test_every_concern_fits_or_is_upstream(torch_dir):
    plan = make_plan(torch_dir, allow_unverified=True)
    assert set(plan.outcomes) == set(concerns())
    assert not [o for o in plan.outcomes.values() if o.state == FAILED]
    for module, patch_files in plan.module_patches.items():
        path = torch_dir.parent.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        source = patched_source(module, path.read_text(encoding="utf-8"), patch_files)
        compile(source, str(path), "exec", dont_inherit=True)
    assert all(o.state != PENDING or o.modules for o in plan.outcomes.values())


def test_sources_of_other_releases_are_checked_in_ci():
    if not SOURCES:
        pytest.skip("DFLASH_TORCH_SOURCES not set: run scripts/fetch_torch_sources.py (CI does)")
    assert len(TREES) >= 4, f"expected 2.11.0, 2.14.1 and 2.15.0 under {SOURCES}"
