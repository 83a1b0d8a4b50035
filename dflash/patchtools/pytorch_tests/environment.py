"""The venv PyTorch's tests of a tag run in: that torch release, what the tests need, this checkout.

Kept in the cache next to the tag's tree and made once (PyPI's Linux wheels are CUDA builds, several
GB; they run on the CPU); this checkout is installed into it on every run, so the startup hook applies
the series of the checkout under test. ``libtorchbind_test.so`` (loaded by ``test_fx.py``'s
``setUp`` and export's torchbind tests) is not in the wheel: it is compiled from the tree's
``test/cpp/jit/test_custom_class_registrations.cpp`` against the wheel by
``torch.utils.cpp_extension`` and put where the tests look for it (``torch/lib``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash.patchtools.pytorch_tests.trees import TagTree

TEST_PACKAGES = (
    "pytest==7.3.2",  # what PyTorch's CI pins; newer pytest refuses v2.6.0's conftest.py
    "pytest-timeout",
    "expecttest",
    "hypothesis",
    "parameterized",
    "z3-solver",  # test_fx_experimental, fx/test_z3_gradual_types
    "pydot",  # fx's graph drawer tests
    "numpy",
    "pillow",
    "ninja",  # torch.utils.cpp_extension builds libtorchbind_test.so with it
    # this checkout's startup hook, its command line and its editable install
    "unidiff",
    "packaging",
    "tqdm",
    "setuptools>=77",  # pyproject.toml's SPDX license field
    "wheel",
)

_BUILD_TORCHBIND = """
import shutil, sys
import torch.utils.cpp_extension as cpp_extension
source, include, build, dest = sys.argv[1:]
built = cpp_extension.load(
    name="torchbind_test",
    sources=[source],
    extra_include_paths=[include],
    is_python_module=False,
    build_directory=build,
)
shutil.copyfile(built, dest)
"""


class VenvError(RuntimeError):
    """The venv could not be made, or the series would not apply in it; the message says why."""


def prepare(tree: TagTree, src: Path, cache: Path, project: Path) -> Path:
    """The python of ``<cache>/<tag>/venv``, made or brought up to date, with ``project`` installed.

    Raises:
        VenvError: pip failed, the venv's torch is not the tag, the torchbind library did not
            build, or the series does not apply there (patched runs would run plain torch).
    """
    venv = cache / tree.tag / "venv"
    python = venv / "bin" / "python"
    wanted = "\n".join([f"torch=={tree.tag}", f"torchvision=={tree.torchvision} --no-deps", *TEST_PACKAGES]) + "\n"
    stamp = venv / "dflash-pytorch-tests.txt"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "make the venv")
    if not stamp.exists() or stamp.read_text() != wanted:
        _pip(python, f"torch=={tree.tag}", *TEST_PACKAGES)
        _pip(python, "--no-deps", f"torchvision=={tree.torchvision}")  # its deps would replace torch
        stamp.write_text(wanted)
    _pip(python, "--no-deps", "--no-build-isolation", "-e", str(project))
    version = torch_version(python)
    if version.split("+")[0] != tree.tag:
        raise VenvError(f"{venv} has torch {version}, not {tree.tag}: delete {venv} and run again")
    _build_torchbind(python, src, cache / tree.tag / "torchbind-build")
    _check_series_applies(python)
    return python


def torch_version(python: Path) -> str:
    """``torch.__version__`` in ``python`` (plain torch: no hook runs)."""
    return _plain_output(python, "import torch; print(torch.__version__)")


def _build_torchbind(python: Path, src: Path, build: Path) -> None:
    torch_lib = Path(
        _plain_output(python, "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
    )
    dest = torch_lib / "libtorchbind_test.so"
    if dest.exists():
        return
    build.mkdir(parents=True, exist_ok=True)
    source = src / "test" / "cpp" / "jit" / "test_custom_class_registrations.cpp"
    env = dict(os.environ, DFLASH_PATCHES="0")
    _run(
        [str(python), "-c", _BUILD_TORCHBIND, str(source), str(src), str(build), str(dest)],
        "build libtorchbind_test.so",
        env,
    )


def _check_series_applies(python: Path) -> None:
    env = dict(os.environ, DFLASH_PATCHES="1")
    done = subprocess.run(
        [str(python), "-m", "dflash", "patches", "status", "--json"], env=env, capture_output=True, text=True
    )
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise VenvError(f"dflash patches status failed in {python}:\n{done.stderr[-2000:]}") from None
    failed = [f"{p['name']}: {p['reason']}" for p in report["patches"] if p["state"] == "failed"]
    if not report["hook_active"] or failed:
        raise VenvError(
            f"the patch series does not apply in {python.parent.parent} (torch {report['torch_version']}), so the "
            "patched runs would run plain torch:\n  " + "\n  ".join(failed or ["the startup hook is not active"])
        )


def _pip(python: Path, *args: str) -> None:
    _run([str(python), "-m", "pip", "install", "-q", *args], f"pip install {' '.join(args)}")


def _plain_output(python: Path, code: str) -> str:
    env = dict(os.environ, DFLASH_PATCHES="0")
    return _run([str(python), "-c", code], "import torch", env).strip().splitlines()[-1]


def _run(command: list[str], what: str, env: dict | None = None) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise VenvError(f"could not {what} (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
    return done.stdout
