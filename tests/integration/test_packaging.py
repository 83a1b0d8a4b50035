"""The startup hook ships with both kinds of install and runs in every kind of child interpreter."""

import multiprocessing
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).parents[2]
STARTUP_FILES = ("dflash-patches.pth", "dflash-patches.start")


def test_editable_install_put_the_hook_in_site_packages():
    # setuptools' editable build is the fragile case (see setup.py): CI installs with `pip install -e .`.
    site = Path(sysconfig.get_paths()["purelib"])
    if not any(site.glob("__editable__*dflash*")):
        import pytest

        pytest.skip("dflash is not installed in editable mode in this environment")
    for name in STARTUP_FILES:
        assert (site / name).read_text() == (REPO / "dflash" / "patching" / name).read_text()


def test_regular_wheel_ships_the_hook_at_its_root(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("dflash-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    for name in STARTUP_FILES:
        assert name in names and f"\n{name}," in "\n" + record, name
    assert "dflash/patch_series/series" in names and "dflash/assets/default_target/model.safetensors" in names
    # The engine reads the generated variants and the verification records at import time.
    assert "dflash/patch_series/records/2.13.0.json" in names and "dflash/patch_series/generated/releases" in names
    assert any(n.startswith("dflash/patch_series/generated/0005-config-process-defaults/") for n in names)


def _child_torch_patched(queue):
    import torch.fx._symbolic_trace as st

    queue.put([c.__name__ for c in type(st).__mro__])


def test_spawned_workers_get_the_patches():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_torch_patched, args=(queue,))
    child.start()
    child.join(300)
    assert "_FxTracingFlagModule" in queue.get(timeout=5)
