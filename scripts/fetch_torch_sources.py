"""Fetch the Python sources of other torch releases, to check the patch series against them.

Downloads each release's wheel from PyPI (``pip download --no-deps``) and
extracts its ``torch/**/*.py`` files into ``DEST/<version>/torch/``; a release
already there is skipped, and the installed torch's release is copied from it.
The wheels are deleted afterwards (~550 MB each).
Used by CI (.ci/run) and by tests that read ``DFLASH_TORCH_SOURCES``.

    python scripts/fetch_torch_sources.py --dest ~/.cache/dflash/torch-src 2.11.0 2.13.0 2.14.1 2.15.0
    python scripts/fetch_torch_sources.py --dest ~/.cache/dflash/torch-src --series   # what CI fetches
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Linux x86_64 wheels; releases up to 2.6 are tagged manylinux1/2014 instead of manylinux_2_28.
PLATFORM_ARGS = [
    arg
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
    for arg in ("--platform", tag)
]


def installed_torch(version: str) -> Path | None:
    """The installed torch folder when it is plain ``version`` (any local label), read without importing it."""
    import importlib.machinery
    import re

    # PathFinder: a find_spec through sys.meta_path would start the dflash import hook
    spec = importlib.machinery.PathFinder.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    text = (folder / "version.py").read_text(encoding="utf-8")
    match = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"+]+)", text, re.M)
    rebuilt = (folder / "_dflash_patches.json").exists()  # dflash patches build-wheel: not the release's text
    return folder if match and match.group(1) == version and not rebuilt else None


def fetch(version: str, dest: Path) -> Path:
    target = dest / version
    if (target / "torch" / "version.py").exists():
        return target
    installed = installed_torch(version)
    if installed is not None:  # the same .py files as the PyPI wheel: no download
        for path in installed.rglob("*.py"):
            copy = target / "torch" / path.relative_to(installed)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(path.read_bytes())
        return target
    with tempfile.TemporaryDirectory() as tmp:
        # The machine-wide pip config may cap torch's version; these wheels are only unpacked, never installed.
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                *PLATFORM_ARGS,
                "-q",
                "-d",
                tmp,
                f"torch=={version}",
            ],
            check=True,
            env=env,
        )
        (wheel,) = Path(tmp).glob("torch-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            members = [n for n in archive.namelist() if n.startswith("torch/") and n.endswith(".py")]
            archive.extractall(target, members)
    return target


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="torch releases, e.g. 2.14.1 2.15.0")
    parser.add_argument(
        "--series",
        action="store_true",
        help="every release the series' variants are generated for (the Base-Release of each patch file)",
    )
    parser.add_argument("--dest", type=Path, required=True, help="folder to extract into")
    args = parser.parse_args()
    versions = list(args.versions)
    if args.series:
        from dflash.patching.series import load_sources

        versions += sorted({str(p.base_release) for p in load_sources()} - set(versions), key=_release_key)
    if not versions:
        parser.error("name torch releases, or pass --series")
    for version in versions:
        print(f"torch {version}: {fetch(version, args.dest)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
