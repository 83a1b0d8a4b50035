"""``dflash patches build-wheel``: a torch wheel rebuilt with the patch series built in.

The fast tests patch a few files taken from the torch 2.13.0 CPU wheel. The slow
test rebuilds the whole wheel (~2 min on 2 cores), installs it into a clean venv
without dflash, and runs two bug-class checks there (classes B and C, which plain
torch 2.13.0 fails) with no startup hook at all.

The wheel is found with ``pip download torch==<installed version> --no-deps --no-index``
(pip's configured ``find-links``; never the network), or set ``DFLASH_TORCH_WHEEL``.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dflash.files import sha256_file
from dflash.patching.plan import ALLOW_UNVERIFIED_ENV, BUILT_IN, WHEEL_MARKER, make_plan
from dflash.patching.series import load_series
from dflash.patchtools.verify.catalogue import applies_to
from dflash.patchtools.verify.checks import CheckResult
from dflash.patchtools.wheel import WheelBuildError, build_wheel, labelled_version, patch_unpacked

REPO = Path(__file__).parents[2]
TORCH_VERSION = importlib.metadata.version("torch")
# torch's Requires-Dist and their own dependencies (so `pip check` passes), pinned to this environment's versions.
TORCH_RUNTIME_DEPS = (
    "filelock",
    "typing_extensions",
    "setuptools",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
)
CHECKED_CLASSES = ("B", "C")


@pytest.fixture(scope="module")
def torch_wheel(tmp_path_factory) -> Iterator[Path]:
    if os.environ.get("DFLASH_TORCH_WHEEL"):
        yield Path(os.environ["DFLASH_TORCH_WHEEL"])
        return
    dest = tmp_path_factory.mktemp("torch-wheel")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"torch=={TORCH_VERSION}",
            "--no-deps",
            "--no-index",
            "-d",
            str(dest),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = sorted(dest.glob("torch-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.skip(
            f"no local torch {TORCH_VERSION} wheel (pip's find-links); set DFLASH_TORCH_WHEEL=PATH: "
            f"{proc.stderr[-300:]}"
        )
    yield found[0]
    # Hundreds of MB: gone once the module is done, not at the session's end (CI's disk is shared).
    shutil.rmtree(dest, ignore_errors=True)


def _series_paths() -> set[str]:
    return {f.path for patch in load_series() for f in patch.files}


def _extract_tree(wheel: Path, dest: Path) -> Path:
    """The files of ``wheel`` that the series touches, plus torch/version.py, laid out as in the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for path in (_series_paths() | {"torch/version.py"}) & names:
            zf.extract(path, dest)
    return dest


def test_labelled_version_keeps_the_existing_label():
    assert labelled_version("2.13.0+cpu") == "2.13.0+cpu.fxsafe1"
    assert labelled_version("2.15.0") == "2.15.0+fxsafe1"
    assert labelled_version("2.15.0+cu132") == "2.15.0+cu132.fxsafe1"
    with pytest.raises(WheelBuildError, match="already carries the label"):
        labelled_version("2.13.0+cpu.fxsafe1")


def test_patch_unpacked_applies_the_series_and_writes_the_marker(torch_wheel, tmp_path):
    root = _extract_tree(torch_wheel, tmp_path)
    before = {p: (root / p).read_text() for p in _series_paths() if (root / p).exists()}
    torch_version, applied, not_applied = patch_unpacked(root, source_name=torch_wheel.name)

    assert torch_version == labelled_version(TORCH_VERSION)
    assert f"__version__ = '{torch_version}'" in (root / "torch/version.py").read_text()
    marker = json.loads((root / "torch" / WHEEL_MARKER).read_text())
    assert marker["patches"] == list(applied) and marker["patch_files"] == list(applied.values())
    assert applied, "nothing was applied to torch 2.13.0"
    by_file = {p.file_name: p for p in load_series()}
    for patch_file in applied.values():
        for patched_file in by_file[patch_file].files:
            text = (root / patched_file.path).read_text()
            assert text != before[patched_file.path]
            added = [line.value for hunk in patched_file for line in hunk if line.is_added]
            assert all(line in text for line in added), f"{patch_file}: added lines missing in {patched_file.path}"
    # The engine reads the marker: every applied concern is built-in, no hook needed.
    plan = make_plan(root / "torch", allow_unverified=False)
    assert {n: o.state for n, o in plan.outcomes.items()} == {n: BUILT_IN for n in applied}
    assert not plan.module_patches
    with pytest.raises(WheelBuildError, match="already a rebuilt wheel"):
        patch_unpacked(root, source_name="again")


def test_refuses_a_torch_release_the_series_was_not_verified_on(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    (tmp_path / "torch").mkdir()
    # 2.14.0: the series has variants for it, but no verification record.
    (tmp_path / "torch/version.py").write_text("__version__ = '2.14.0+cpu'\n")
    match = rf"torch 2.14.0\+cpu(.|\n)*not verified on torch 2.14.0(.|\n)*{ALLOW_UNVERIFIED_ENV}=1"
    with pytest.raises(WheelBuildError, match=match):
        patch_unpacked(tmp_path, source_name="torch-2.14.0.whl")
    assert not (tmp_path / "torch" / WHEEL_MARKER).exists()


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        build_wheel(out_dir=tmp_path)
    with pytest.raises(WheelBuildError, match="no such wheel file"):
        build_wheel(torch_wheel=tmp_path / "torch-9.9.9-py3-none-any.whl", out_dir=tmp_path / "out")


# --- the slow one: full rebuild, install into a clean venv, bug-class checks there ------------------


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def installed_venv(torch_wheel, tmp_path_factory):
    """(venv python, built wheel): the rebuilt wheel in a venv that has torch's runtime deps and no dflash."""
    work = tmp_path_factory.mktemp("rebuilt")
    input_hash = sha256_file(torch_wheel)
    start = time.monotonic()
    _run(
        [
            sys.executable,
            "-c",
            "import sys; from dflash.cli import main; sys.exit(main(sys.argv[1:]))",
            "patches",
            "build-wheel",
            "--torch-wheel",
            torch_wheel,
            "--out",
            work / "dist",
        ],
        timeout=600,
    )
    built = time.monotonic()
    assert sha256_file(torch_wheel) == input_hash, "build-wheel modified its input"
    (wheel,) = (work / "dist").glob("*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in TORCH_RUNTIME_DEPS]
    # The host's pip installs into the venv (--python): no pip inside the venv, no bytecode compiling.
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-compile", "-q", wheel, *pins],
        timeout=600,
    )
    print(f"\nbuild-wheel {built - start:.0f} s, venv install {time.monotonic() - built:.0f} s")
    yield python, wheel
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
def test_rebuilt_wheel_installs_is_thread_safe_without_dflash_and_reports_its_patches_built_in(installed_venv):
    """One test, so that one rebuild serves every check of the wheel (split over two xdist workers,
    the rebuild ran in each: ~2 CPU-minutes)."""
    python, wheel = installed_venv
    expected = labelled_version(TORCH_VERSION)
    assert wheel.name.startswith(f"torch-{expected}-")
    _run([sys.executable, "-m", "pip", "--python", python, "check"])
    # -P: no current folder on sys.path (the checkout holds dflash/).
    probe = _run(
        [
            python,
            "-P",
            "-c",
            "import importlib.metadata as m, importlib.util as u, torch; "
            "print(torch.__version__, m.version('torch'), u.find_spec('dflash'))",
        ],
        env=dict(os.environ, DFLASH_PATCHES="0"),
    )
    assert probe.stdout.split() == [expected, expected, "None"], "wrong versions, or dflash importable in the venv"

    # The checks need only torch and the repository on PYTHONPATH: the venv has no dflash and no hook.
    def check(interpreter, bug_class):
        proc = _run(
            [interpreter, "-m", "dflash.patchtools.verify.runner", bug_class, "--seconds", "1", "--json"],
            env=dict(os.environ, DFLASH_PATCHES="0", PYTHONPATH=str(REPO)),
            timeout=300,
        )
        return CheckResult(**json.loads(proc.stdout.strip().splitlines()[-1]))

    runs = [(python, c) for c in CHECKED_CLASSES] + [(sys.executable, c) for c in CHECKED_CLASSES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(runs, pool.map(lambda run: check(*run), runs)))
    for bug_class in CHECKED_CLASSES:
        assert applies_to(bug_class, TORCH_VERSION) is True
        rebuilt, plain = results[(python, bug_class)], results[(sys.executable, bug_class)]
        assert rebuilt.calls > 0 and plain.calls > 0
        assert rebuilt.failures == 0, f"class {bug_class} on the rebuilt wheel: {rebuilt}"
        assert plain.failures > 0, f"class {bug_class} did not reproduce on plain torch {TORCH_VERSION}: {plain}"

    site_packages = next(python.parent.parent.glob("lib/python*/site-packages"))
    # The host interpreter (dflash and its hook installed) importing the rebuilt torch first on sys.path.
    proc = _run(
        [
            sys.executable,
            "-c",
            "import sys; from dflash.cli import main; sys.exit(main(sys.argv[1:]))",
            "patches",
            "status",
            "--json",
        ],
        env=dict(os.environ, PYTHONPATH=str(site_packages)),
    )
    report = json.loads(proc.stdout)
    marker = json.loads((site_packages / "torch" / WHEEL_MARKER).read_text())
    assert report["torch_version"] == labelled_version(TORCH_VERSION)
    assert [(p["name"], p["state"]) for p in report["patches"]] == [(n, BUILT_IN) for n in marker["patches"]]
