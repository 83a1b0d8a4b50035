"""Rebuild a torch wheel with the patch series built in: ``dflash patches build-wheel``.

The patched torch needs no startup hook: its Python files carry the fix, and
``torch/_dflash_patches.json`` (:data:`~dflash.patching.plan.WHEEL_MARKER`) tells
the engine (``dflash patches status``) to report those concerns as ``built-in``
and install nothing. Steps (see ``docs/packaging.md``, "Rebuilding a
torch wheel"):

1. ``wheel unpack`` the input wheel, or copy the installed torch's files listed
   in its dist-info ``RECORD``;
2. plan exactly as the import hook does (:func:`~dflash.patching.plan.make_plan`
   on the unpacked ``torch/``) and apply each pending concern's hunks to its
   modules (exact context, never fuzz); refuse if any concern is ``failed``;
3. add the local version label (``2.13.0+cpu`` -> ``2.13.0+cpu.fxsafe1``) to
   ``torch/version.py`` and to the wheel's metadata, and write the marker;
4. ``wheel pack --local-version``, which regenerates every ``RECORD`` hash.

The input file and the installed torch are only read.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.version import Version

from dflash.patching.plan import ALLOW_UNVERIFIED_ENV, FAILED, PENDING, WHEEL_MARKER, make_plan
from dflash.patchtools import needs_extra

log = logging.getLogger(__name__)

# Appended to the local version label. Bump the number when the series changes what a rebuilt wheel contains.
LOCAL_LABEL = "fxsafe1"
# dist-info files that describe one installation, not the distribution (PEP 376, PEP 610).
_INSTALL_ONLY = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


class WheelBuildError(RuntimeError):
    """The wheel cannot be rebuilt; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class BuiltWheel:
    """What :func:`build_wheel` wrote.

    Attributes:
        path: the new ``.whl`` file.
        version: the wheel's new version (``2.13.0+cpu.fxsafe1``).
        torch_version: ``torch.__version__`` of the rebuilt torch.
        applied: concern -> patch file built in.
        not_applied: concern -> its state and reason (``upstream``, ``not-applicable``).
    """

    path: Path
    version: str
    torch_version: str
    applied: dict[str, str]
    not_applied: dict[str, str]


def labelled_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0+cpu.fxsafe1``; ``2.15.0`` -> ``2.15.0+fxsafe1`` (PEP 440 local label).

    Raises:
        WheelBuildError: ``version`` already carries our label (the input is a rebuilt wheel).
    """
    local = Version(version).local
    if local is not None and LOCAL_LABEL in local.split("."):
        raise WheelBuildError(
            f"version {version} already carries the label {LOCAL_LABEL}: the input is a rebuilt wheel"
        )
    return f"{version}.{LOCAL_LABEL}" if local else f"{version}+{LOCAL_LABEL}"


def _run_wheel_cli(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "wheel", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelBuildError(f"`wheel {' '.join(args)}` failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def _unpack(torch_wheel: Path, staging: Path) -> Path:
    if not torch_wheel.is_file():
        raise WheelBuildError(f"{torch_wheel}: no such wheel file (pass the path of a torch-*.whl)")
    _run_wheel_cli("unpack", "--dest", str(staging), str(torch_wheel))
    (root,) = staging.iterdir()
    return root


def _copy_installed(staging: Path) -> Path:
    """Copy the installed torch's distribution (its RECORD, minus bytecode and scripts) into ``staging``."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        raise WheelBuildError("torch is not installed in this environment; pass --torch-wheel PATH instead") from None
    if not dist.files:
        raise WheelBuildError(
            f"the installed torch ({dist.version}) has no RECORD file listing its files; "
            "pass --torch-wheel PATH (e.g. from `pip download torch==<version> --no-deps`)"
        )
    root = staging / f"torch-{dist.version}"
    skipped = 0
    for file in dist.files:
        dist_info = file.parts[0].endswith(".dist-info")
        # '..' entries are console scripts pip generated from entry_points.txt; pip makes them again.
        if file.parts[0] == ".." or "__pycache__" in file.parts or (dist_info and file.name in _INSTALL_ONLY):
            skipped += 1
            continue
        target = root / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(dist.locate_file(file), target)
    log.info(
        "copied the installed torch %s (%d files skipped: bytecode, scripts, install records)", dist.version, skipped
    )
    return root


def _dist_info(root: Path) -> Path:
    found = [p for p in root.iterdir() if p.name.endswith(".dist-info") and p.is_dir()]
    if len(found) != 1 or not found[0].name.startswith("torch-"):
        raise WheelBuildError(f"{root}: expected one torch-*.dist-info folder, found {[p.name for p in found]}")
    return found[0]


def _patch_modules(root: Path, plan) -> None:
    from dflash.patching.hunks import PatchDoesNotFit
    from dflash.patching.importhook import patched_source
    from dflash.patching.series import load_series, module_name

    paths = {module_name(f.path): f.path for patch in load_series() for f in patch.files}
    for module, patch_files in plan.module_patches.items():
        path = root / paths[module]
        try:
            source = path.read_bytes().decode("utf-8")
            path.write_bytes(patched_source(module, source, patch_files).encode("utf-8"))
        except (OSError, PatchDoesNotFit) as error:
            raise WheelBuildError(
                f"cannot patch {module}: {error}. This torch build differs from the source the series was "
                "written for; build from a release `dflash patches coverage` lists as verified"
            ) from None


def _set_torch_version(torch_dir: Path, version: str) -> None:
    path = torch_dir / "version.py"
    text = path.read_text(encoding="utf-8")
    new, count = re.subn(
        r"^(__version__\s*(?::\s*str\s*)?=\s*)(['\"])[^'\"]*\2", rf"\g<1>'{version}'", text, flags=re.M
    )
    if count != 1:
        raise WheelBuildError(f"{path}: expected one __version__ line, found {count}")
    path.write_text(new, encoding="utf-8")


def _dflash_version() -> str:
    try:
        return importlib.metadata.version("dflash")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (dflash run from a source tree)"


def patch_unpacked(root: Path, *, source_name: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """Apply the series to an unpacked torch wheel at ``root`` (the folder holding ``torch/``) in place.

    Edits the patched modules, ``torch/version.py`` and writes the marker. Returns
    ``(new torch.__version__, applied, not_applied)`` as in :class:`BuiltWheel`.

    Raises:
        WheelBuildError: the torch there is already rebuilt, a concern is ``failed``
            (e.g. a torch release the series was not verified on), or a hunk does not fit.
    """
    torch_dir = root / "torch"
    if (torch_dir / WHEEL_MARKER).exists():
        raise WheelBuildError(
            f"{source_name} is already a rebuilt wheel ({WHEEL_MARKER} present); start from plain torch"
        )
    plan = make_plan(torch_dir, allow_unverified=os.environ.get(ALLOW_UNVERIFIED_ENV, "0") == "1")
    failed = [o for o in plan.outcomes.values() if o.state == FAILED]
    if failed:
        reasons = "\n".join(f"  {o.name}: {o.reason}" for o in failed)
        raise WheelBuildError(f"refusing to build from {source_name} (torch {plan.release}):\n{reasons}")
    _patch_modules(root, plan)
    applied = {o.name: o.patch_file for o in plan.outcomes.values() if o.state == PENDING}
    not_applied = {o.name: f"{o.state}: {o.reason}" for o in plan.outcomes.values() if o.state != PENDING}
    torch_version = labelled_version(plan.release)
    _set_torch_version(torch_dir, torch_version)
    marker = {
        "patches": list(applied),
        "patch_files": list(applied.values()),
        "not_applied": not_applied,
        "dflash_version": _dflash_version(),
        "original_torch_version": plan.release,
        "built_from": source_name,
    }
    (torch_dir / WHEEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    return torch_version, applied, not_applied


def build_wheel(*, torch_wheel: Path | None = None, from_installed: bool = False, out_dir: Path) -> BuiltWheel:
    """Write a torch wheel with the patch series applied into ``out_dir``.

    Args:
        torch_wheel: a torch ``.whl`` file (read only); or
        from_installed: rebuild from the torch installed in this environment.
        out_dir: where the new wheel goes (created if missing; a file of the same name is replaced).

    Raises:
        WheelBuildError: see :func:`patch_unpacked`; also a missing input, ``wheel`` not installed
            (names the extra that installs it) or failing.
        ValueError: neither or both sources given.
    """
    if (torch_wheel is None) == (not from_installed):
        raise ValueError("give exactly one of torch_wheel and from_installed")
    if importlib.util.find_spec("wheel") is None:
        raise WheelBuildError(needs_extra("wheel", "dflash patches build-wheel"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # Staging next to the output: an unpacked torch takes ~1 GB, and the final move stays on one file system.
    with tempfile.TemporaryDirectory(prefix=".dflash-build-wheel-", dir=out_dir) as tmp:
        staging = Path(tmp)
        root = _unpack(torch_wheel, staging / "src") if torch_wheel else _copy_installed(staging / "src")
        source_name = torch_wheel.name if torch_wheel else "the installed torch"
        torch_version, applied, not_applied = patch_unpacked(root, source_name=source_name)
        dist_version = _dist_info(root).name.removeprefix("torch-").removesuffix(".dist-info")
        version = labelled_version(dist_version)
        packed = staging / "packed"
        packed.mkdir()
        _run_wheel_cli("pack", "--dest-dir", str(packed), "--local-version", Version(version).local, str(root))
        (built,) = packed.iterdir()
        path = out_dir / built.name
        os.replace(built, path)
    return BuiltWheel(path, version, torch_version, applied, not_applied)
