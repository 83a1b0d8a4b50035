"""Which torch releases the patch series covers: ``dflash patches coverage [--json]``.

Per release from 2.5 to the newest known (those the last refresh saw, those with a verification
record, the installed one, and any source trees given):

- ``verified``: every concern has a variant for it, generated on its sources, and the release's
  record (``patches/records/<release>.json``) names each applied variant's diff sha256;
- ``fits``: the variants exist and fit its sources, but no record matches them (the reason says why);
- ``unsupported``: a concern has no variant for it, or a hunk does not fit (the reason names it).

``records_match`` says whether a record exists and names exactly the diffs applied today;
``installed`` marks the release of the torch importable here. Development trees (``2.16.0a0``)
are reported with ``dev: true``; tests never assert on them.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
from pathlib import Path

from packaging.version import Version

from dflash.patching.plan import FAILED, PENDING, choose_variant, torch_release
from dflash.patching.records import all_records, load_record, verified_diff
from dflash.patching.series import GENERATED_DIR, concerns, read_lines
from dflash.patching.series_path import series_dir

FIRST = Version("2.5")
RELEASES_FILE = f"{GENERATED_DIR}/releases"
VERIFIED, FITS, UNSUPPORTED = "verified", "fits", "unsupported"


@dataclasses.dataclass
class Coverage:
    version: str
    state: str
    records_match: bool
    reason: str
    dev: bool = False
    installed: bool = False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def installed_torch() -> tuple[str, Path] | None:
    """(torch.__version__, torch folder) of the torch importable here, read without importing it."""
    # PathFinder: a find_spec through sys.meta_path would start the dflash import hook
    spec = importlib.machinery.PathFinder.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return torch_release(folder), folder


def _trees(sources: Path | None, installed: tuple[str, Path] | None) -> dict[str, Path]:
    """Version string -> torch folder, for every ``<version>/torch`` under ``sources`` and the installed torch.

    Raises:
        ValueError: ``sources`` is not a directory, or holds no ``<version>/torch`` tree.
    """
    trees = {}
    if sources is not None:
        if not sources.is_dir():
            raise ValueError(
                "no such directory; pass a folder of <version>/torch trees (scripts/fetch_torch_sources.py)"
            )
        for entry in sorted(sources.iterdir()):
            if (entry / "torch" / "version.py").exists():
                trees[torch_release(entry / "torch")] = entry / "torch"
        if not trees:
            raise ValueError(
                "holds no <version>/torch/version.py tree; pass the folder scripts/fetch_torch_sources.py filled"
            )
    if installed is not None:
        trees.setdefault(installed[0], installed[1])
    return trees


def known_releases(trees: dict[str, Path]) -> list[str]:
    releases_file = series_dir() / RELEASES_FILE
    names = set(read_lines(releases_file)) if releases_file.exists() else set()
    names |= set(all_records()) | set(trees)
    return sorted((n for n in names if Version(n) >= FIRST), key=Version)


def _fits_tree(tree: Path) -> str | None:
    """None when every planned hunk fits the tree at ``tree``, else the reason."""
    from dflash.patching.importhook import plan_all_or_none

    plan = plan_all_or_none(tree, allow_unverified=True)
    failed = next((o for o in plan.outcomes.values() if o.state == FAILED), None)
    return None if failed is None else failed.reason


def release_coverage(version: str, tree: Path | None) -> Coverage:
    """The coverage of one release (``2.13.0``, ``2.13.0+cpu`` or a dev tree's ``2.16.0a0``)."""
    parsed = Version(version)
    release = Version(parsed.base_version)
    dev = parsed.is_devrelease or parsed.is_prerelease
    record = None if dev else load_record(release)
    outcomes = [choose_variant(n, v, release, True) for n, v in concerns().items()]
    chosen = {
        o.name: next(p for p in concerns()[o.name] if p.file_name == o.patch_file)
        for o in outcomes
        if o.state == PENDING
    }
    matches = record is not None and all(verified_diff(record, n) == p.diff_sha256 for n, p in chosen.items())
    failed = next((o for o in outcomes if o.state == FAILED), None)
    if failed is not None:
        return Coverage(version, UNSUPPORTED, matches, f"{failed.name}: {failed.reason}", dev)
    if tree is not None:
        problem = _fits_tree(tree)
    else:
        unseen = [p.file_name for p in chosen.values() if release not in p.generated_on]
        problem = (
            f"{unseen[0]} was not generated on {release}'s sources (run the refresh with them)" if unseen else None
        )
    if problem is not None:
        return Coverage(version, UNSUPPORTED, matches, problem, dev)
    if matches:
        return Coverage(version, VERIFIED, True, "", dev)
    if record is None:
        reason = f"no verification record: run `dflash patches verify --record` with torch {release} installed"
    else:
        changed = [f"{n} ({p.file_name})" for n, p in chosen.items() if verified_diff(record, n) != p.diff_sha256]
        reason = f"changed since the record of {record['date']}: {', '.join(changed)}; verify again with --record"
    if dev:
        reason = "development tree, never verified: the newest variants fit it"
    return Coverage(version, FITS, False, reason, dev)


def collect(sources: Path | None = None) -> list[Coverage]:
    """Coverage of every known release from 2.5 on, oldest first (``sources``: extra ``<version>/torch`` trees).

    Raises:
        ValueError: see :func:`_trees`.
    """
    installed = installed_torch()
    trees = _trees(sources, installed)
    installed_public = Version(installed[0]).public if installed is not None else None
    known = known_releases(trees)
    out = []
    for version in known:
        parsed = Version(version)
        final = not (parsed.is_prerelease or parsed.is_devrelease)
        if final and parsed.local and parsed.public in known:
            continue  # 2.13.0+cpu is reported as 2.13.0
        tree = trees.get(version) or next(
            (t for v, t in trees.items() if final and Version(v).public == parsed.public), None
        )
        coverage = release_coverage(parsed.public if final else version, tree)
        coverage.installed = parsed.public == installed_public
        out.append(coverage)
    return out
