"""Build the stack on a PyTorch checkout: pick each concern's patch, rebase it exactly, add its tests,
commit on a private index and ``git format-patch`` the commits.

The checkout is only read: commits are made with git plumbing on a private index (objects land in the
repository's object store; no ref, index or file of the checkout changes), and the patches are checked
with ``git apply --check --cached`` in order on another private index.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

from packaging.version import Version

from dflash.patching.hunks import PatchDoesNotFit, apply_hunks
from dflash.patching.plan import FAILED, NOT_APPLICABLE, UPSTREAM, choose_variant
from dflash.patching.series import Patch
from dflash.patchtools.upstream.concerns import UpstreamConcern
from dflash.patchtools.upstream.placement import apply_method_edit, apply_placement
from dflash.patchtools.upstream.tree import UpstreamKitError, git, head_file, restore_crlf, split_crlf

# States of a concern in the kit, besides the plan's `upstream` and `not-applicable`.
REBASED, PRESENT, DOES_NOT_APPLY, KEPT_OUT = "rebased", "already-present", "does-not-apply", "kept-out"
PROPOSED = "proposed"  # drafted on top of the stack for a design proposal, not a PR of its own


@dataclasses.dataclass
class Commit:
    """One concern as a commit: the patch used, the new texts of the files it changes (fix and tests)."""

    concern: UpstreamConcern
    patch: Patch
    fix_files: dict[str, str]
    test_files: dict[str, str]
    notes: list[str]
    how: list[str] = dataclasses.field(default_factory=list)  # the message's how paragraphs, set by the kit

    @property
    def files(self) -> dict[str, str]:
        return {**self.fix_files, **self.test_files}


def pick_patch(concern: UpstreamConcern, variants: list[Patch], version: Version) -> tuple[str, Patch | None, str]:
    """(state, patch to use, reason) for ``concern`` on a tree of release ``version``.

    A release no variant claims (a development tree, a release newer than the patches) gets the
    newest variant, tried by exact application: the tree decides, and the reason says so.
    """
    outcome = choose_variant(concern.name, variants, version, allow_unverified=True)
    if outcome.state in (UPSTREAM, NOT_APPLICABLE):
        return outcome.state, None, outcome.reason
    if outcome.state == FAILED:
        newest = max(variants, key=lambda p: max((Version(s.version) for s in p.torch_versions), default=Version("0")))
        return "try", newest, f"no patch claims {version}; tried the newest ({newest.file_name}) by exact application"
    return "try", next(p for p in variants if p.file_name == outcome.patch_file), ""


def _fix_present(source: str, patched_file) -> bool:
    """Every hunk's target side (context and added lines) is in ``source`` already, up to blank lines
    and the imports the kit tidies (:func:`.lint.tidy_imports`: ``# noqa: E402`` removed, repeated
    imports dropped, misplaced ones moved)."""
    for hunk in patched_file:
        target = [line.value for line in hunk if not line.is_removed]
        tidied = {re.sub(r"\s+# noqa: E402\n$", "\n", t) for t in target if re.search(r"# noqa: E402\n$", t)}
        kept = [line for line in source.splitlines(keepends=True) if line.strip() and line not in tidied]
        if tidied:
            target = [t for t in target if not re.search(r"# noqa: E402\n$", t)]
        if "".join(t for t in target if t.strip()) not in "".join(kept):
            return False
    return True


def rebase(patch: Patch, read) -> tuple[str, str, dict[str, str], list[str]]:
    """(state, reason, new texts, notes) of ``patch`` applied exactly to the files ``read(path)`` gives.

    A file with CRLF line endings is patched on its LF form and written back with CRLF (noted).
    """
    out, present, notes = {}, [], []
    for patched_file in patch.files:
        path = patched_file.path
        raw = read(path)
        if raw is None:
            return DOES_NOT_APPLY, f"{path} is not in the tree", {}, notes
        source, crlf = split_crlf(raw)
        if crlf:
            notes.append(f"{path} has CRLF line endings: patched on its LF form, written back with CRLF")
        try:
            out[path] = restore_crlf(apply_hunks(source, patched_file, label=patch.file_name), crlf)
        except PatchDoesNotFit as error:
            if not _fix_present(source, patched_file):
                return DOES_NOT_APPLY, f"{error}; rebase {patch.file_name} by hand", {}, notes
            present.append(path)
    if present and len(present) == len(patch.files):
        return PRESENT, f"the target side of every hunk of {patch.file_name} is already in the tree", {}, notes
    if present:
        return DOES_NOT_APPLY, f"{patch.file_name} is half in the tree already ({', '.join(present)})", {}, notes
    return REBASED, f"{patch.file_name} applies exactly", out, notes


def add_tests(concern: UpstreamConcern, read) -> dict[str, str]:
    """New texts of the test files for ``concern``: its placements, then its edits of upstream tests.

    Raises:
        UpstreamKitError: a test file it needs is missing, or a method to edit is not there.
    """
    files: dict[str, str] = {}

    def current(path: str) -> str | None:
        return files[path] if path in files else read(path)

    for placement in concern.tests:
        files.update(apply_placement(placement, current))
    for edit in concern.edits:
        text = current(edit.target)
        if text is None:
            raise UpstreamKitError(f"{edit.target} is not in the tree (the kit updates {edit.cls}.{edit.method})")
        files[edit.target] = apply_method_edit(edit, text)
    return files


def reader(src: Path, state: dict[str, str]):
    """``read(path)``: the text of ``path`` in ``state`` (files changed by earlier commits) or at ``HEAD``."""
    return lambda path: state[path] if path in state else head_file(src, path)


def commit_stack(src: Path, base: str, commits: list[tuple[dict[str, str], str]], out: Path) -> tuple[list[Path], str]:
    """Commit each (files, message) on a private index, stacked on ``base``; ``git format-patch`` into ``out``.

    Returns:
        the patch files, and the id of the last commit (``base`` when there are none).

    Raises:
        UpstreamKitError: git has no author identity, or a git command fails.
    """
    try:
        git(src, "var", "GIT_AUTHOR_IDENT")
    except UpstreamKitError:
        raise UpstreamKitError(
            f"git has no author identity in {src}: set git config user.name and user.email"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(src, "read-tree", base, env=env)
        parent = base
        for files, message in commits:
            for path, text in files.items():
                blob = git(src, "hash-object", "-w", "--stdin", stdin=text.encode("utf-8")).strip()
                listed = git(src, "ls-files", "-s", "--", path, env=env).split()
                mode = listed[0] if listed else "100644"
                git(src, "update-index", "--add", "--cacheinfo", f"{mode},{blob},{path}", env=env)
            tree = git(src, "write-tree", env=env).strip()
            parent = git(src, "commit-tree", tree, "-p", parent, "-F", "-", stdin=message).strip()
    out.mkdir(parents=True, exist_ok=True)
    names = git(src, "format-patch", "--no-signature", "-o", str(out.resolve()), f"{base}..{parent}").split()
    return [Path(name) for name in names], parent


def check_patches(src: Path, patches: list[Path]) -> None:  # in order: the stack, then the drafts
    """``git apply --check`` each patch on ``HEAD`` plus the patches before it (a private index; no file changes).

    Raises:
        UpstreamKitError: a patch does not apply; the message has git's reason.
    """
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(src, "read-tree", "HEAD", env=env)
        for patch in patches:
            git(src, "apply", "--check", "--cached", str(patch.resolve()), env=env)
            git(src, "apply", "--cached", str(patch.resolve()), env=env)
