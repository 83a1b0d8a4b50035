"""Read a PyTorch checkout without changing it: its version, its files at ``HEAD``, git plumbing."""

from __future__ import annotations

import subprocess
from pathlib import Path

from packaging.version import InvalidVersion, Version

from dflash.patching.plan import torch_release


class UpstreamKitError(RuntimeError):
    """The kit cannot be made; the message says why and what to do."""


def tree_release(src: Path) -> str:
    """The tree's torch version: ``version.txt`` (a git checkout) or ``torch/version.py`` (a built tree).

    Raises:
        UpstreamKitError: neither file is there, or it holds no version.
    """
    if (src / "version.txt").is_file():
        return (src / "version.txt").read_text(encoding="utf-8").strip()
    if (src / "torch" / "version.py").is_file():
        try:
            return torch_release(src / "torch")
        except ValueError as error:
            raise UpstreamKitError(str(error)) from None
    raise UpstreamKitError(f"{src}: no version.txt nor torch/version.py; pass the root of a PyTorch checkout")


def release_version(release: str, src: Path) -> Version:
    """``2.16.0a0`` -> ``Version('2.16.0')``: development and local builds count as their release.

    Raises:
        UpstreamKitError: ``release`` is not a PEP 440 version.
    """
    try:
        return Version(Version(release).base_version)
    except InvalidVersion:
        raise UpstreamKitError(f"{src}: torch version {release!r} is not a PEP 440 version (e.g. 2.16.0a0)") from None


def refuse_release_tree(release: str, src: Path) -> None:
    """The kit is for PyTorch main: a tree whose version has no development suffix is a release tree.

    Raises:
        UpstreamKitError: ``release`` (``version.txt``) is a final release such as ``2.15.0``.
    """
    version = Version(release)
    if not (version.is_prerelease or version.is_devrelease):
        raise UpstreamKitError(
            f"{src} is a release tree (version {release}); the upstream kit is made for a PyTorch main "
            "checkout only (version.txt of a development version, such as 2.16.0a0). Release trees get the "
            "fix through the startup hook (pip install -e . in this project, then import torch) and the "
            "rebuilt wheel (`dflash patches build-wheel`)."
        )


def git(src: Path, *args: str, env: dict | None = None, stdin: str | bytes | None = None) -> str:
    """stdout of ``git args`` in ``src``.

    Raises:
        UpstreamKitError: git exits non-zero (its message included).
    """
    data = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
    proc = subprocess.run(["git", *args], cwd=src, env=env, input=data, capture_output=True)
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise UpstreamKitError(f"`git {' '.join(args)}` in {src} failed: {message}")
    return proc.stdout.decode("utf-8")


def head_file(src: Path, path: str) -> str | None:
    """Text of ``path`` at ``HEAD`` (line endings as committed), or None when it is not there."""
    proc = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=src, capture_output=True)
    return proc.stdout.decode("utf-8") if proc.returncode == 0 else None


def split_crlf(text: str) -> tuple[str, bool]:
    """(``text`` with LF line endings, whether it had CRLF ones): the series is written with LF."""
    return (text.replace("\r\n", "\n"), True) if "\r\n" in text else (text, False)


def restore_crlf(text: str, crlf: bool) -> str:
    return text.replace("\n", "\r\n") if crlf else text
