"""Regenerate each torch release's variant of every concern from its source diff: the refresh.

A concern's fix is written once, as a diff against one release (``Base-Release:`` of its
canonical file ``patches/NNNN-<concern>.patch``, or of an era file ``NNNN-<concern>@<era>.patch``
where torch's code differs enough that the fix differs). For every release whose sources are in
the folder given (``scripts/fetch_torch_sources.py``), the refresh carries the patched base text
onto that release's text with a three-way merge (base as released, base patched, release as
released; the ``merge3`` package), and diffs the result again with three lines of context. Releases
whose variants come out alike (the earlier one applies to the later one exactly, with the same
result) share one file. A merge conflict (the patch changes lines that this release changed too)
needs a human: the refresh names the concern, release, module and lines, writes nothing for that
concern, and exits 1. The source files' own diffs are rewritten in the same normal form (their
headers are kept byte for byte, so DEP-3 text edits never conflict with a refresh).

    python -m dflash.patchtools.refresh --sources ~/.cache/dflash/torch-src          # rewrite generated/
    python -m dflash.patchtools.refresh --sources ~/.cache/dflash/torch-src --check  # CI: are they current?

``--check`` compares semantically, release by release, for the releases present: the committed
variant that claims a release must apply to its sources exactly and give what the refresh gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dflash.patching.hunks import PatchDoesNotFit, apply_hunks
from dflash.patching.series import (
    GENERATED_DIR,
    Patch,
    canonical_stem,
    load_series,
    load_sources,
    split_patch,
)
from dflash.patching.series_path import series_dir
from dflash.patchtools import MissingExtra, needs_extra

try:
    import merge3
except ImportError:
    raise MissingExtra(needs_extra("merge3", "dflash patches refresh")) from None

CONTEXT_LINES = 3
GENERATED_BY = "python -m dflash.patchtools.refresh (generated: edit the source file named below, then refresh)"


class NeedsHuman(Exception):
    """A source diff cannot be carried onto a release mechanically; the message says where and why."""


def release_trees(sources: Path) -> dict[Version, Path]:
    """Final releases under ``sources`` (``<version>/torch/version.py``), oldest first; dev trees are skipped."""
    trees = {}
    for entry in sources.iterdir() if sources.is_dir() else ():
        if not (entry / "torch" / "version.py").exists():
            continue
        try:
            version = Version(entry.name)
        except ValueError:
            continue
        if not (version.is_prerelease or version.is_devrelease or version.local):
            trees[version] = entry
    return dict(sorted(trees.items()))


def unified(path: str, old: str, new: str) -> str:
    """``git diff``-style text of one file, three lines of context, ``a/`` and ``b/`` prefixes."""
    for text in (old, new):
        if text and not text.endswith("\n"):
            raise NeedsHuman(f"{path}: a file without a final newline is not supported")
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=CONTEXT_LINES
    )
    return "".join(lines)


def _show(lines: list[str]) -> str:
    shown = [repr(line) for line in lines[:3]] + (["..."] if len(lines) > 3 else [])
    return "[" + ", ".join(shown) + "]" if lines else "[nothing]"


def _changes(base: list[str], other: list[str]) -> list[tuple[int, int, list[str]]]:
    """``other`` as edits of ``base``: (start, end, replacement lines), in base coordinates."""
    matcher = difflib.SequenceMatcher(None, base, other, autojunk=False)
    return [(i1, i2, other[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def _touch(one: tuple[int, int, list[str]], other: tuple[int, int, list[str]]) -> bool:
    (s1, e1, _), (s2, e2, _) = one, other
    if s1 == e1 or s2 == e2:  # an insertion touches anything at or around its point
        return s2 <= s1 <= e2 or s1 <= s2 <= e1
    return s1 < e2 and s2 < e1


def merge_lines_apart(base: list[str], ours: list[str], theirs: list[str]) -> list[str] | None:
    """Both sides' edits of ``base`` applied, when no base line is edited by both (else None).

    ``merge3`` (like diff3) calls edits of adjacent lines a conflict; this finer check lets a
    patch change a function body where a release only retyped its signature line.
    """
    mine, yours = _changes(base, ours), _changes(base, theirs)
    if any(_touch(m, y) for m in mine for y in yours):
        return None
    out, cursor = [], 0
    for start, end, lines in sorted(mine + yours, key=lambda c: (c[0], c[1])):
        out += base[cursor:start] + lines
        cursor = end
    return out + base[cursor:]


def carry(base_orig: str, base_patched: str, target: str, *, where: str) -> str:
    """``target`` with the changes ``base_orig`` -> ``base_patched`` merged in (three-way).

    Raises:
        NeedsHuman: the patch changes lines that also differ between the base and the target.
    """
    if target == base_orig:
        return base_patched
    base, ours, theirs = (t.splitlines(keepends=True) for t in (base_orig, base_patched, target))
    out: list[str] = []
    for region in merge3.Merge3(base, ours, theirs).merge_regions():
        kind = region[0]
        if kind == "unchanged":
            out += base[region[1] : region[2]]
        elif kind in ("a", "same"):
            out += ours[region[1] : region[2]]
        elif kind == "b":
            out += theirs[region[1] : region[2]]
        else:
            z0, z1, a0, a1, b0, b1 = region[1:]
            merged = merge_lines_apart(base[z0:z1], ours[a0:a1], theirs[b0:b1])
            if merged is not None:
                out += merged
                continue
            raise NeedsHuman(
                f"{where}: the patch changes lines {z0 + 1}-{z1} of the base, and this release has other "
                f"lines there.\n    base:    {_show(base[z0:z1])}\n    patched: {_show(ours[a0:a1])}\n"
                f"    release: {_show(theirs[b0:b1])}"
            )
    return "".join(out)


@dataclasses.dataclass
class Generated:
    """One concern on one release: each module's (original, patched) text."""

    release: Version
    texts: dict[str, tuple[str, str]]

    def diff(self) -> str:
        return "".join(unified(path, old, new) for path, (old, new) in self.texts.items())

    def fits(self, diff_text: str) -> bool:
        """Whether ``diff_text`` applies to this release exactly and gives the same patched texts."""
        from dflash.patching.series import parse_patch

        files = parse_patch("candidate", f"Patch-Name: x\nTorch-Versions: >=0\n---\n{diff_text}").files
        if sorted(f.path for f in files) != sorted(self.texts):
            return False
        try:
            return all(apply_hunks(self.texts[f.path][0], f, label="candidate") == self.texts[f.path][1] for f in files)
        except PatchDoesNotFit:
            return False


def _read(tree: Path, path: str, *, where: str) -> str:
    file = tree / path
    if not file.exists():
        raise NeedsHuman(f"{where}: {path} does not exist in this release")
    return file.read_bytes().decode("utf-8")


def base_texts(source: Patch, trees: dict[Version, Path]) -> dict[str, tuple[str, str]]:
    """(original, patched) text of each module ``source`` edits, on its base release.

    Raises:
        NeedsHuman: the base release's sources are missing, or the source diff does not apply to them.
    """
    tree = trees.get(source.base_release)
    if tree is None:
        raise NeedsHuman(
            f"{source.file_name}: no sources of its base release {source.base_release}; "
            f"run scripts/fetch_torch_sources.py {source.base_release}"
        )
    texts = {}
    for patched_file in source.files:
        original = _read(tree, patched_file.path, where=f"{source.file_name} on {source.base_release}")
        try:
            texts[patched_file.path] = (original, apply_hunks(original, patched_file, label=source.file_name))
        except PatchDoesNotFit as error:
            raise NeedsHuman(f"{error} (the source file must apply to its own base release)") from None
    return texts


def applies(source: Patch, release: Version) -> bool:
    if source.applied_upstream is not None and release >= source.applied_upstream:
        return False
    if source.affects_versions is not None and not source.affects_versions.contains(release, prereleases=True):
        return False
    return source.torch_versions.contains(release, prereleases=True)


def generate(source: Patch, trees: dict[Version, Path]) -> list[Generated]:
    """The concern of ``source`` on every release in ``trees`` it covers, oldest first.

    Raises:
        NeedsHuman: on the first release where the diff cannot be carried over.
    """
    base = base_texts(source, trees)
    out = []
    for release, tree in trees.items():
        if not applies(source, release):
            continue
        texts = {}
        for path, (original, patched) in base.items():
            where = f"{source.file_name} on torch {release}, {path}"
            texts[path] = (_read(tree, path, where=where), None)
            texts[path] = (texts[path][0], carry(original, patched, texts[path][0], where=where))
        out.append(Generated(release, texts))
    return out


def _bounds(spec: SpecifierSet, *, where: str) -> tuple[str | None, str | None]:
    lower = [s.version for s in spec if s.operator == ">="]
    upper = [s.version for s in spec if s.operator == "<"]
    if len(spec) != len(lower) + len(upper) or len(lower) > 1 or len(upper) > 1:
        raise NeedsHuman(f"{where}: Torch-Versions must be '>=X' or '>=X,<Y', not {str(spec)!r}")
    return (lower[0] if lower else None), (upper[0] if upper else None)


@dataclasses.dataclass
class Variant:
    """A generated file: one diff and the releases it was made from."""

    source: Patch
    diff_text: str
    releases: list[Version]
    lower: str | None = None
    upper: str | None = None

    @property
    def torch_versions(self) -> str:
        return ",".join(part for part in (self.lower and f">={self.lower}", self.upper and f"<{self.upper}") if part)

    @property
    def path(self) -> str:
        return f"{GENERATED_DIR}/{canonical_stem(self.source)}/torch-{self.lower or '0'}.patch"

    def text(self) -> str:
        return (
            f"Patch-Name: {self.source.name}\n"
            f"Generated-By: {GENERATED_BY}\n"
            f"Generated-From: {self.source.file_name}\n"
            f"Generated-On: {', '.join(str(r) for r in self.releases)}\n"
            f"Torch-Versions: {self.torch_versions}\n"
            f"---\n{self.diff_text}"
        )


def _boundary(release: Version, all_releases: list[Version]) -> str:
    """``X.Y`` when ``release`` is the first of its minor in ``all_releases``, else the release itself."""
    same_minor = [r for r in all_releases if r.release[:2] == release.release[:2]]
    return f"{release.major}.{release.minor}" if min(same_minor) == release else str(release)


def group(source: Patch, generated: list[Generated], all_releases: list[Version]) -> list[Variant]:
    """Variants of ``source``: consecutive releases share one while the earlier diff fits the later exactly."""
    lower, upper = _bounds(source.torch_versions, where=source.file_name)
    variants: list[Variant] = []
    for item in generated:
        if variants and item.fits(variants[-1].diff_text):
            variants[-1].releases.append(item.release)
            continue
        if variants:
            variants[-1].upper = _boundary(item.release, all_releases)
        variants.append(Variant(source, item.diff(), [item.release], _boundary(item.release, all_releases), upper))
    if variants:
        variants[0].lower = lower
    return variants


def normalized_source(source: Patch, trees: dict[Version, Path]) -> str:
    """The source file's text with its diff in normal form (header kept byte for byte)."""
    head, _ = split_patch(source.file_name, (series_dir() / source.file_name).read_text(encoding="utf-8"))
    diff = "".join(unified(path, old, new) for path, (old, new) in base_texts(source, trees).items())
    return f"{head}\n---\n{diff}"


@dataclasses.dataclass
class ConcernResult:
    name: str
    variants: list[Variant]
    sources: dict[str, str]  # file name -> normalized text
    generated: dict[Version, Generated] = dataclasses.field(default_factory=dict)
    problem: str | None = None


def refresh_concern(name: str, sources: list[Patch], trees: dict[Version, Path]) -> ConcernResult:
    all_releases = list(trees)
    variants, generated = [], {}
    try:
        for source in sources:
            items = generate(source, trees)
            generated.update((g.release, g) for g in items)
            variants += group(source, items, all_releases)
        normal = {s.file_name: normalized_source(s, trees) for s in sources}
    except NeedsHuman as problem:
        return ConcernResult(name, [], {}, problem=str(problem))
    return ConcernResult(name, variants, normal, generated)


def refresh_all(trees: dict[Version, Path], only: list[str] | None = None) -> list[ConcernResult]:
    by_concern: dict[str, list[Patch]] = {}
    for source in load_sources():
        by_concern.setdefault(source.name, []).append(source)
    unknown = sorted(set(only or ()) - set(by_concern))
    if unknown:
        raise SystemExit(f"unknown concern {', '.join(unknown)}; the series has {', '.join(by_concern)}")
    return [refresh_concern(n, s, trees) for n, s in by_concern.items() if not only or n in only]


def write(result: ConcernResult) -> list[str]:
    """Replace the concern's generated files (and normalize its sources); returns the paths written."""
    root = series_dir()
    stems = {canonical_stem(v.source) for v in result.variants} | {
        canonical_stem(s) for s in load_sources() if s.name == result.name
    }
    for stem in stems:
        for old in (root / GENERATED_DIR / stem).glob("*.patch"):
            old.unlink()
    written = []
    for variant in result.variants:
        target = root / variant.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(variant.text(), encoding="utf-8")
        written.append(variant.path)
    for file_name, text in result.sources.items():
        if (root / file_name).read_text(encoding="utf-8") != text:
            (root / file_name).write_text(text, encoding="utf-8")
            written.append(file_name)
    return written


def stale(result: ConcernResult) -> list[str]:
    """What in the committed series differs from ``result`` (for the releases in ``trees``)."""
    problems = []
    committed = [p for p in load_series() if p.name == result.name]
    for variant in result.variants:
        for release in variant.releases:
            claiming = [p for p in committed if p.torch_versions.contains(release, prereleases=True)]
            if len(claiming) != 1 or not result.generated[release].fits(claiming[0].diff_text):
                problems.append(
                    f"{result.name} on torch {release}: the committed variant "
                    f"{claiming[0].file_name if claiming else '(none claims it)'} is not what "
                    f"{variant.source.file_name} gives"
                )
    root = series_dir()
    for file_name, text in result.sources.items():
        if (root / file_name).read_text(encoding="utf-8") != text:
            problems.append(f"{file_name}: its diff is not in normal form (three lines of context, git diff style)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.patchtools.refresh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=Path, required=True, help="folder of <version>/torch trees")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the generated files are stale")
    parser.add_argument("concerns", nargs="*", help="concerns to refresh (default: all)")
    args = parser.parse_args(argv)
    trees = release_trees(args.sources)
    if not trees:
        print(
            f"refresh: no torch release trees under {args.sources}; run scripts/fetch_torch_sources.py", file=sys.stderr
        )
        return 2
    print(f"releases: {', '.join(str(r) for r in trees)}")
    if not args.check and not args.concerns:
        # The releases coverage reports on, whether or not a concern has a variant for them.
        (series_dir() / GENERATED_DIR).mkdir(exist_ok=True)
        (series_dir() / GENERATED_DIR / "releases").write_text("".join(f"{r}\n" for r in trees))
    status = 0
    for result in refresh_all(trees, args.concerns):
        if result.problem is not None:
            status = 1
            print(f"NEEDS A HUMAN  {result.name}: {result.problem}", file=sys.stderr)
            continue
        if args.check:
            problems = stale(result)
            for problem in problems:
                print(f"STALE  {problem}", file=sys.stderr)
            status |= bool(problems)
            if not problems:
                print(f"current  {result.name}")
            continue
        for path in write(result):
            print(f"wrote  {path}")
        for variant in result.variants:
            releases = ", ".join(str(r) for r in variant.releases)
            print(f"  {result.name:<40} {variant.torch_versions:<16} {releases}")
    if status and not args.check:
        print(
            "Fix each NEEDS A HUMAN above: change the source file so its hunks avoid lines that release changed, "
            "or add an era file NNNN-<concern>@<era>.patch (Patch-Name, Base-Release, Torch-Versions, then its "
            "diff) for the releases where the fix must differ, and narrow the other file's Torch-Versions.",
            file=sys.stderr,
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
