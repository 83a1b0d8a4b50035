"""An exact PyTorch release tag's ``test/`` tree, fetched once into the cache.

PyPI's sdists and wheels carry no ``test/`` and the repository is GBs; Debian's source package of a
release carries the tag's whole tree (its ``orig`` tarball repacks the tag without vendored code and
CI files; ``test/`` is whole). The tarball is pinned by sha256, so a mirror serves that tree or
nothing. What the archives served on 2026-12-06: Debian trixie's ``pytorch 2.6.0+dfsg-7``; Debian
sid and forky list ``2.14.1+dfsg-1`` but the mirror answers 404 for its files (its binary packages
are served, without ``test/``), experimental and the backports have none, snapshot.debian.org is not
reachable; Ubuntu resolute carries Debian's ``2.9.1+dfsg-1~exp1`` upload (``-1~exp1ubuntu2``) and
serves its tarball, the newest tag here.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TagTree:
    """Where a release tag's tree is: a Debian (or Ubuntu) archive's ``orig`` tarball of the tag."""

    tag: str  # the torch release, e.g. "2.6.0"
    package: str  # the source package that carries it, for the reports
    archive: str  # the archive's base URL (another mirror of it: --mirror)
    pool: str  # the package's folder in the archive
    tarball: str
    sha256: str
    top: str  # the tarball's top folder
    torchvision: str  # the torchvision release built for this torch (test_fx.py's vision tracing)

    def url(self, mirror: str | None = None) -> str:
        return f"{(mirror or self.archive).rstrip('/')}/{self.pool}/{self.tarball}"


TREES = {
    "2.6.0": TagTree(
        tag="2.6.0",
        package="Debian's pytorch 2.6.0+dfsg-7 (trixie)",
        archive="http://deb.debian.org/debian",
        pool="pool/main/p/pytorch",
        tarball="pytorch_2.6.0+dfsg.orig.tar.xz",
        sha256="099a9601bc40d67656e75735c44abedb0fbe92d08817852ab7472eebb7e6ddff",
        top="pytorch-v2.6.0",
        torchvision="0.21.0",
    ),
    "2.9.1": TagTree(
        tag="2.9.1",
        package="Debian's pytorch 2.9.1+dfsg-1~exp1 as Ubuntu's 2.9.1+dfsg-1~exp1ubuntu2 (resolute)",
        archive="http://archive.ubuntu.com/ubuntu",
        pool="pool/universe/p/pytorch",
        tarball="pytorch_2.9.1+dfsg.orig.tar.xz",
        sha256="28fdfe67285a4f638dd586679cf36db32656b24efde38230d0860b6a59720aee",
        top="pytorch-v2.9.1",
        torchvision="0.24.1",
    ),
}
NEWEST = max(TREES, key=lambda tag: tuple(int(part) for part in tag.split(".")))


def tag_tree(tag: str) -> TagTree:
    """The known tree of ``tag``; ``ValueError`` naming the known tags otherwise."""
    try:
        return TREES[tag]
    except KeyError:
        raise ValueError(
            f"no test tree is known for torch {tag}: known tags are {', '.join(TREES)} "
            "(add a Debian source package of that release to dflash/patchtools/pytorch_tests/trees.py)"
        ) from None


def fetch(tree: TagTree, cache: Path, mirror: str | None = None) -> Path:
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
