"""Read the patch series: ``patches/series``, DEP-3 headers, unified diffs.

Two kinds of files (``patches/README.md``):

- *source* files, listed in ``series``: per concern one canonical file (``NNNN-<concern>.patch``,
  the only place of its DEP-3 text: Description, Bug, Origin, Forwarded...) and, where torch's code
  differs enough that the fix itself differs, era files (``NNNN-<concern>@<era>.patch``, no text
  fields). Each holds a diff against one release (``Base-Release``) and covers ``Torch-Versions``.
- *variants*, generated from them by ``python -m dflash.patchtools.refresh`` for each release
  (``generated/NNNN-<concern>/torch-<X.Y>.patch``): what the engine applies.

The series ships inside the package as ``dflash.patch_series`` (``setup.py`` maps the top-level
``patches/`` folder to it), so the import hook, the wheel builder and the PR kit all read the same
files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from pathlib import Path

import unidiff
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dflash.patching.series_path import series_dir

#: Fields that explain a concern; they live in its canonical file only.
TEXT_FIELDS = ("Description", "Bug", "Origin", "Forwarded", "Applied-Upstream", "Affects-Versions")
GENERATED_DIR = "generated"


class SeriesError(ValueError):
    """The patch series itself is malformed (a packaging bug, not a torch mismatch)."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One ``.patch`` file of the series: a source file or a generated variant.

    Attributes:
        file_name: path relative to the series folder, e.g. ``generated/0003-<concern>/torch-2.12.patch``.
        name: the concern (``Patch-Name:``); the files of one concern share it.
        header: the concern's DEP-3 fields (from its canonical file) updated with this file's own.
        diff_text: the unified diff below the ``---`` line.
        torch_versions: the releases this file is for (``Torch-Versions:``).
        applied_upstream: first torch release that has the fix (``Applied-Upstream:``), if any.
        affects_versions: the releases that have the bug (``Affects-Versions:``; absent: all).
        base_release: source files: the release whose text the diff is against.
        generated_on: variants: the releases whose sources it was generated from and checked against.
    """

    file_name: str
    name: str
    header: dict[str, str]
    diff_text: str
    torch_versions: SpecifierSet
    applied_upstream: Version | None = None
    affects_versions: SpecifierSet | None = None
    base_release: Version | None = None
    generated_on: tuple[Version, ...] = ()

    @functools.cached_property
    def files(self) -> tuple[unidiff.PatchedFile, ...]:
        return tuple(unidiff.PatchSet(self.diff_text))

    @property
    def modules(self) -> tuple[str, ...]:
        """Dotted names of the torch modules this patch edits."""
        return tuple(module_name(f.path) for f in self.files)

    @property
    def description(self) -> str:
        return self.header.get("Description", "").strip()

    @property
    def diff_sha256(self) -> str:
        """Hash of what the engine applies (the diff, not the header): verification records name it."""
        return diff_sha256(self.diff_text)


def diff_sha256(diff_text: str) -> str:
    return hashlib.sha256(diff_text.encode("utf-8")).hexdigest()


def module_name(path: str) -> str:
    """``torch/compiler/__init__.py`` -> ``torch.compiler``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def parse_header(text: str) -> dict[str, str]:
    """DEP-3 fields: ``Name: value`` lines, continued by lines that start with a space.

    (``email.parser`` reads the same syntax but costs ~35 ms to import, and this
    runs while ``import torch`` is in progress.)
    """
    fields: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and name is not None:
            fields[name] += "\n" + line[1:]
        elif (match := re.match(r"([A-Za-z][A-Za-z0-9-]*):\s?(.*)", line)) is not None:
            name = match.group(1)
            fields[name] = match.group(2)
    return fields


def split_patch(file_name: str, text: str) -> tuple[str, str]:
    """(header text, diff text) of a series file.

    Raises:
        SeriesError: no ``---`` line between them.
    """
    head, sep, diff_text = text.partition("\n---\n")
    if not sep:
        raise SeriesError(f"{file_name}: no '---' line between the DEP-3 header and the diff")
    return head, diff_text


def _versions(text: str) -> tuple[Version, ...]:
    return tuple(Version(v.strip()) for v in text.split(",") if v.strip())


def parse_patch(file_name: str, text: str, *, text_header: dict[str, str] | None = None) -> Patch:
    """Parse a series file; ``text_header`` is its concern's canonical header (for era files and variants).

    Raises:
        SeriesError: no ``---`` separator, or a required field missing or malformed.
    """
    head, diff_text = split_patch(file_name, text)
    own = parse_header(head)
    header = {**(text_header or {}), **own}
    try:
        name = header["Patch-Name"]
        torch_versions = SpecifierSet(header["Torch-Versions"])
        upstream = header.get("Applied-Upstream", "").strip()
        applied_upstream = Version(upstream) if upstream and upstream != "no" else None
        affects = SpecifierSet(header["Affects-Versions"]) if "Affects-Versions" in header else None
        base = Version(own["Base-Release"]) if "Base-Release" in own else None
        generated_on = _versions(own.get("Generated-On", ""))
    except KeyError as missing:
        raise SeriesError(f"{file_name}: DEP-3 header lacks the field {missing}") from None
    except ValueError as bad:
        raise SeriesError(f"{file_name}: malformed version field in the DEP-3 header: {bad}") from None
    return Patch(file_name, name, header, diff_text, torch_versions, applied_upstream, affects, base, generated_on)


def read_lines(path: Path) -> list[str]:
    """The entries of a list file (``series``): one a line, ``#`` starts a comment."""
    return [n for n in (line.split("#", 1)[0].strip() for line in path.read_text().splitlines()) if n]


@functools.cache
def load_sources() -> tuple[Patch, ...]:
    """The source files listed in ``series`` (canonical and era files), in order.

    Raises:
        SeriesError: a file is malformed, a concern's text fields are in an era file or missing
            from its canonical file, or a source file lacks ``Base-Release``.
    """
    root = series_dir()
    raw = [
        (n, parse_header(split_patch(n, (root / n).read_text(encoding="utf-8"))[0]), root / n)
        for n in read_lines(root / "series")
    ]
    texts: dict[str, dict[str, str]] = {}
    for file_name, own, _ in raw:
        if "@" in file_name:
            stray = [f for f in TEXT_FIELDS if f in own]
            if stray:
                raise SeriesError(
                    f"{file_name}: era files carry no text fields ({', '.join(stray)}); keep them in the canonical file"
                )
        elif "Patch-Name" in own:
            texts[own["Patch-Name"]] = {k: v for k, v in own.items() if k in TEXT_FIELDS}
    out = []
    for file_name, own, path in raw:
        name = own.get("Patch-Name")
        if name not in texts:
            raise SeriesError(
                f"{file_name}: its concern {name!r} has no canonical file (NNNN-<concern>.patch) in series"
            )
        patch = parse_patch(file_name, path.read_text(encoding="utf-8"), text_header=texts[name])
        if patch.base_release is None:
            raise SeriesError(f"{file_name}: DEP-3 header lacks the field 'Base-Release'")
        out.append(patch)
    return tuple(out)


def canonical_stem(patch: Patch) -> str:
    """``0005-config-process-defaults@pre-2.12.patch`` -> ``0005-config-process-defaults``."""
    return patch.file_name.removesuffix(".patch").split("@", 1)[0]


@functools.cache
def load_series() -> tuple[Patch, ...]:
    """The generated variants, concern by concern in ``series`` order, each concern's in release order.

    Raises:
        SeriesError: as :func:`load_sources`, or a variant is malformed.
    """
    root = series_dir()
    out: list[Patch] = []
    seen: set[str] = set()
    for source in load_sources():
        stem = canonical_stem(source)
        if stem in seen:
            continue
        seen.add(stem)
        folder = root / GENERATED_DIR / stem
        files = sorted(folder.glob("*.patch")) if folder.is_dir() else []
        text = {k: v for k, v in source.header.items() if k in TEXT_FIELDS}
        variants = [
            parse_patch(f"{GENERATED_DIR}/{stem}/{f.name}", f.read_text(encoding="utf-8"), text_header=text)
            for f in files
        ]
        variants.sort(key=lower_bound)
        out.extend(variants)
    return tuple(out)


def lower_bound(patch: Patch) -> Version:
    """The ``>=`` bound of ``Torch-Versions`` (0 when there is none)."""
    return max((Version(s.version) for s in patch.torch_versions if s.operator == ">="), default=Version("0"))


def concerns() -> dict[str, list[Patch]]:
    """Concern name -> its variants, in series order."""
    out: dict[str, list[Patch]] = {p.name: [] for p in load_sources()}
    for patch in load_series():
        out[patch.name].append(patch)
    return out
