"""An exact PyTorch release tag's ``test/`` tree, fetched once into the cache.

PyPI's sdists and wheels carry no ``test/`` and the repository is GBs; Debian's source package of a
release carries the tag's whole tree (its ``orig`` tarball repacks the tag without vendored code and
CI files; ``test/`` is whole). The tarball is pinned by sha256, so a mirror serves that tree or
nothing. Newer releases: Debian lists ``pytorch 2.14.1+dfsg-1`` (sid, forky) but its mirrors did not
serve the files on 2026-12-06 (404), so 2.6.0 is the newest tag here.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class TagTree:
    """Where a release tag's tree is: Debian's ``orig`` tarball of the tag, by name and sha256."""

    tag: str  # the torch release, e.g. "2.6.0"
    debian_version: str  # the source package version that carries it
    tarball: str  # file name in the mirror's pool/main/p/pytorch/
    sha256: str
    top: str  # the tarball's top folder
    torchvision: str  # the torchvision release built for this torch (test_fx.py's vision tracing)

    def url(self, mirror: str) -> str:
        return f"{mirror.rstrip('/')}/pool/main/p/pytorch/{self.tarball}"


TREES = {
    "2.6.0": TagTree(
        tag="2.6.0",
        debian_version="2.6.0+dfsg-7",  # trixie
        tarball="pytorch_2.6.0+dfsg.orig.tar.xz",
        sha256="099a9601bc40d67656e75735c44abedb0fbe92d08817852ab7472eebb7e6ddff",
        top="pytorch-v2.6.0",
        torchvision="0.21.0",
    ),
}


def tag_tree(tag: str) -> TagTree:
    """The known tree of ``tag``; ``ValueError`` naming the known tags otherwise."""
    try:
        return TREES[tag]
    except KeyError:
        raise ValueError(
            f"no test tree is known for torch {tag}: known tags are {', '.join(TREES)} "
            "(add Debian's source package of that release to dflash/patchtools/pytorch_tests/trees.py)"
        ) from None


def fetch(tree: TagTree, cache: Path, mirror: str = DEFAULT_MIRROR) -> Path:
    """``<cache>/<tag>/src``: the tag's repository root holding ``test/`` only (downloaded once).

    Raises:
        ValueError: the mirror served a file whose sha256 is not the pinned one.
        OSError: the download failed (the URL is in the message).
    """
    root = cache / tree.tag / "src"
    if (root / "test" / "conftest.py").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        tarball = Path(tmp) / tree.tarball
        _download(tree.url(mirror), tarball, tree.sha256)
        prefix = f"{tree.top}/test/"
        with tarfile.open(tarball, "r:xz") as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            extract = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(tmp, members, **extract)
        shutil.rmtree(root, ignore_errors=True)
        (Path(tmp) / tree.top).rename(root)
    return root


def _download(url: str, dest: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as response, dest.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as error:
        raise OSError(f"could not download {url}: {error} (another mirror: --mirror URL)") from error
    if digest.hexdigest() != sha256:
        raise ValueError(f"{url} has sha256 {digest.hexdigest()}, not the pinned {sha256}: refusing that tree")
