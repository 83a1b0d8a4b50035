"""Turn the patch series into a pull-request kit for a PyTorch checkout: ``dflash patches upstream``.

For a PyTorch git tree (main or a release branch) it decides, with the engine's
plan logic, which concerns are upstream already for that tree's version
(``version.txt`` at the root, e.g. ``2.16.0a0``, or ``torch/version.py``), detects
fixes already present in the source (every hunk's target side found), rebases the
rest onto the tree's ``HEAD`` (exact hunks, never fuzz) and writes:

- ``patches/NNNN-*.patch``: one ``git format-patch`` commit per concern, stacked in
  series order, each adding its upstream-style test (``upstream_tests/<area>/`` in
  this package: ``test/<area>/test_thread_safety_<concern>.py`` in the tree);
- ``PR_DESCRIPTION.md``: problem, reproducer, fix, why the lock is off the hot
  path, benchmark numbers (from ``--benchmark-json``, else "not measured"), links.

The checkout is only read: commits are made with git plumbing on a private index
(objects land in the repository's object store, no ref or file changes), and the
patches are checked with ``git apply --check --cached`` in order on another one.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.resources
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from packaging.version import Version

from dflash.patching.plan import NOT_APPLICABLE, PENDING, UPSTREAM, choose_variant, torch_release
from dflash.patching.series import Patch, concerns

# States of a concern in the kit (besides the plan's `upstream` and `not-applicable`).
REBASED, PRESENT, DOES_NOT_APPLY = "rebased", "already-present", "does-not-apply"
# The umbrella issue of torch.compile thread safety (docs/bug-classes.md): a PR is part of it, never fixes it.
UMBRELLA_ISSUES = {"118260"}
# Our race-class letters (docs/bug-classes.md) mean nothing upstream: "(class C)", "Race class D."
_CLASS_REF = re.compile(r"\s*\((?:race )?class(?:es)? [^)]*\)|^Race class(?:es)? [A-H](?:(?:, | and )[A-H])*\.\s*")
LOCK_TEXT = """\
The flags these patches touch become attributes of a `threading.local`: reading one is an
attribute lookup on the calling thread's state, with no lock. The only lock
(`_SharedEvalFrameSetting` in `torch/_dynamo/eval_frame.py`) is taken once when a compiled call
enters and once when it leaves, to count the threads inside; it is never held while compiled
code runs. A thread waits only when it needs a different value of an eval-frame setting than
the threads already inside compiled code (a stance change, `isolate_recompiles=True`), so
steady-state calls from several threads stay parallel."""


class UpstreamKitError(RuntimeError):
    """The kit cannot be made; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class ConcernReport:
    """What the kit did with one concern: ``state`` (upstream, already-present, rebased, not-applicable,
    does-not-apply), ``reason``, and for ``rebased`` the patch file written."""

    name: str
    state: str
    reason: str
    patch_path: Path | None = None


@dataclasses.dataclass(frozen=True)
class _Commit:
    patch: Patch
    area: str
    test_path: str
    test_source: str
    files: dict[str, str]


def tree_release(src: Path) -> str:
    """The tree's torch version: ``version.txt`` (a git checkout) or ``torch/version.py`` (a built tree).

    Raises:
        UpstreamKitError: neither file is there, or it holds no version.
    """
    if (src / "version.txt").is_file():
        return (src / "version.txt").read_text(encoding="utf-8").strip()
    if (src / "torch" / "version.py").is_file():
        return torch_release(src / "torch")
    raise UpstreamKitError(f"{src}: no version.txt nor torch/version.py; pass the root of a PyTorch checkout")


def _git(src: Path, *args: str, env: dict | None = None, stdin: str | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=src, env=env, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UpstreamKitError(f"`git {' '.join(args)}` in {src} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _head_file(src: Path, path: str) -> str | None:
    proc = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=src, capture_output=True)
    return proc.stdout.decode("utf-8") if proc.returncode == 0 else None


def _upstream_test(concern: str) -> tuple[str, str, str]:
    """(area, path in the PyTorch tree, source) of the upstream-style test written for ``concern``."""
    stem = f"test_thread_safety_{concern.replace('-', '_')}.py"
    root = importlib.resources.files("dflash.patchtools") / "upstream_tests"
    for area in ("fx", "dynamo"):
        if (root / area / stem).is_file():
            return area, f"test/{area}/{stem}", (root / area / stem).read_text(encoding="utf-8")
    raise UpstreamKitError(
        f"no upstream test for concern {concern}: add dflash/patchtools/upstream_tests/<fx|dynamo>/{stem}"
    )


def _fix_present(source: str, patched_file) -> bool:
    """Every hunk's target side (context and added lines) is in ``source`` already."""
    return all("".join(line.value for line in hunk if not line.is_removed) in source for hunk in patched_file)


def _rebase(src: Path, patch: Patch, current: dict[str, str]) -> tuple[str, str, dict[str, str]]:
    """(state, reason, new file texts) for ``patch`` on the tree as ``current``
    (path -> text: HEAD plus the earlier commits)."""
    from dflash.patching.hunks import PatchDoesNotFit, apply_hunks

    out, present = {}, []
    for patched_file in patch.files:
        path = patched_file.path
        source = current.get(path) if path in current else _head_file(src, path)
        if source is None:
            return DOES_NOT_APPLY, f"{path} is not in the tree", {}
        try:
            out[path] = apply_hunks(source, patched_file, label=patch.file_name)
        except PatchDoesNotFit as error:
            if not _fix_present(source, patched_file):
                return DOES_NOT_APPLY, f"{error}; rebase {patch.file_name} by hand", {}
            present.append(path)
    if present and len(present) == len(patch.files):
        return PRESENT, f"the target side of every hunk of {patch.file_name} is already in the tree", {}
    if present:
        return DOES_NOT_APPLY, f"{patch.file_name} is half in the tree already ({', '.join(present)})", {}
    return REBASED, f"{patch.file_name} applies to the tree exactly", out


def _paragraphs(patch: Patch) -> list[str]:
    """The DEP-3 description below its summary line, as paragraphs (``.`` lines separate them)."""
    body = patch.description.split("\n", 1)[1] if "\n" in patch.description else ""
    paragraphs = [_CLASS_REF.sub("", p.strip()) for p in re.split(r"^\.$", body, flags=re.M)]
    # "Variant for 2.13-2.15 ..." notes say which of our variants this is: nothing for upstream.
    return [p for p in paragraphs if p and not p.startswith("Variant ")]


def _title(commit: _Commit) -> str:
    summary = _CLASS_REF.sub("", commit.patch.description.split("\n", 1)[0]).strip()
    return f"[{commit.area}] {summary[:1].upper()}{summary[1:]}"


def _links(patch: Patch) -> list[str]:
    """``Fixes #N`` / ``Part of #N`` / ``See also #N`` lines from the ``Bug:`` and ``Origin:`` URLs."""
    urls = re.findall(r"https://github.com/pytorch/pytorch/(issues|pull)/(\d+)", patch.header.get("Bug", ""))
    lines = []
    for kind, number in dict.fromkeys(urls):
        if kind == "pull":
            lines.append(f"See also #{number}")
        else:
            lines.append(f"{'Part of' if number in UMBRELLA_ISSUES else 'Fixes'} #{number}")
    return lines


def _message(commit: _Commit) -> str:
    body = "\n\n".join(_paragraphs(commit.patch))
    test_plan = f"Test plan:\npython {commit.test_path}"
    return f"{_title(commit)}\n\n{body}\n\n{test_plan}\n\n" + "\n".join(_links(commit.patch)) + "\n"


def _commit_stack(src: Path, base: str, commits: list[_Commit], out: Path) -> list[Path]:
    """Commit each concern on a private index, stacked on ``base``; ``git format-patch`` them into ``out``."""
    try:
        _git(src, "var", "GIT_AUTHOR_IDENT")
    except UpstreamKitError:
        raise UpstreamKitError(
            f"git has no author identity in {src}: set git config user.name and user.email"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(src, "read-tree", base, env=env)
        parent = base
        for commit in commits:
            for path, text in {**commit.files, commit.test_path: commit.test_source}.items():
                blob = _git(src, "hash-object", "-w", "--stdin", stdin=text).strip()
                listed = _git(src, "ls-files", "-s", "--", path, env=env).split()
                mode = listed[0] if listed else "100644"
                _git(src, "update-index", "--add", "--cacheinfo", f"{mode},{blob},{path}", env=env)
            tree = _git(src, "write-tree", env=env).strip()
            parent = _git(src, "commit-tree", tree, "-p", parent, "-F", "-", stdin=_message(commit)).strip()
    out.mkdir(parents=True, exist_ok=True)
    names = _git(src, "format-patch", "--no-signature", "-o", str(out.resolve()), f"{base}..{parent}").split()
    return [Path(name) for name in names]


def check_patches(src: Path, patches: list[Path]) -> None:
    """``git apply --check`` each patch on ``HEAD`` plus the patches before it (a private index; no file changes).

    Raises:
        UpstreamKitError: a patch does not apply; the message has git's reason.
    """
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(src, "read-tree", "HEAD", env=env)
        for patch in patches:
            _git(src, "apply", "--check", "--cached", str(patch.resolve()), env=env)
            _git(src, "apply", "--cached", str(patch.resolve()), env=env)


def _benchmark_text(benchmark_json: Path | None) -> str:
    if benchmark_json is None:
        return "Not measured."
    try:
        data = json.loads(benchmark_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UpstreamKitError(f"cannot read the benchmark JSON {benchmark_json}: {error}") from None
    rows = sorted((int(m.group(1)), v) for k, v in data.items() if (m := re.fullmatch(r"calls_per_s_(\d+)_threads", k)))
    if not rows:
        raise UpstreamKitError(
            f"{benchmark_json} has no calls_per_s_<N>_threads entries: write it with "
            "`python benchmarks/patch_overhead.py --json PATH`"
        )
    lines = [
        f"Calls per second of a small `torch.compile`d function (backend `{data.get('backend', '?')}`), "
        f"torch {data.get('torch', '?')}, medians of alternating runs, ratio = median of the per-round ratios "
        "(`benchmarks/patch_overhead.py` in dflash):",
        "",
        "| threads | without the fix | with the fix | ratio |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {r['plain']:,.0f} | {r['patched']:,.0f} | {_ratio_cell(r)} |" for n, r in rows]
    return "\n".join(lines)


def _ratio_cell(result: dict) -> str:
    # JSON from before the interval was added, or from too few rounds, has no interval.
    if not result.get("ratio_ci95"):
        return f"{result['ratio']:.3f}"
    low, high = result["ratio_ci95"]
    return f"{result['ratio']:.3f} (95% CI {low:.3f} to {high:.3f})"


def _first_test_source(test_source: str) -> str:
    """Source of the first ``test_*`` method of an upstream test file (the reproducer shown in the PR)."""
    for node in ast.walk(ast.parse(test_source)):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            return ast.get_source_segment(test_source, node)
    raise UpstreamKitError("an upstream test file has no test_* method")


def _pr_description(
    release: str, base: str, commits: list[_Commit], reports: list[ConcernReport], benchmark: str
) -> str:
    out = [f"# Thread-safe torch.compile and FX: {len(commits)} fixes (PyTorch {release}, base {base[:12]})", ""]
    out += ["## Problem", ""]
    for commit in commits:
        out += [f"### {_title(commit)}", "", _paragraphs(commit.patch)[0], ""]
    out += [
        "## Reproducer",
        "",
        "Each commit adds a test that holds the racing region open in one thread with events and checks "
        "another thread meanwhile, so it needs no timing luck:",
        "",
    ]
    for commit in commits:
        out += [f"`python {commit.test_path}`", "", "```python", _first_test_source(commit.test_source), "```", ""]
    out += ["## Fix", ""]
    for commit in commits:
        out += [f"- **{_title(commit)}**: " + " ".join(" ".join(_paragraphs(commit.patch)[1:]).split())]
    out += ["", "## Why the lock is off the hot path", "", LOCK_TEXT, "", "## Benchmark", "", benchmark, ""]
    others = [r for r in reports if r.state != REBASED]
    if others:
        out += ["## Not in this stack", "", "| concern | state | why |", "|---|---|---|"]
        out += [f"| {r.name} | {r.state} | {r.reason.replace('|', '/')} |" for r in others]
        out.append("")
    links = dict.fromkeys(line for c in commits for line in _links(c.patch))
    stacked = {c.patch.name for c in commits}
    related = dict.fromkeys(
        f"Related: #{n}"
        for name, variants in concerns().items()
        if name not in stacked
        for p in variants
        for n in re.findall(r"github.com/pytorch/pytorch/(?:issues|pull)/(\d+)", p.header.get("Bug", ""))
        if f"#{n}" not in " ".join(links)
    )
    out += ["## Linked issues", ""] + [f"- {line}" for line in [*links, *related]] + [""]
    return "\n".join(out)


def make_kit(src: Path, out: Path, *, benchmark_json: Path | None = None) -> list[ConcernReport]:
    """Write the pull-request kit for the PyTorch checkout ``src`` into ``out``; returns what became of each concern.

    Raises:
        UpstreamKitError: ``src`` is not a git checkout with a torch version, git fails, a concern has no
            upstream test, the benchmark JSON is unreadable, or a produced patch fails ``git apply --check``.
    """
    src = src.resolve()
    if not (src / "torch").is_dir():
        raise UpstreamKitError(f"{src}: no torch/ folder; pass the root of a PyTorch checkout")
    if list((out / "patches").glob("*.patch")):
        raise UpstreamKitError(f"{out / 'patches'} already holds .patch files: pass an empty or new --out folder")
    benchmark = _benchmark_text(benchmark_json)
    base = _git(src, "rev-parse", "--verify", "HEAD^{commit}").strip()
    release = tree_release(src)
    version = Version(Version(release).base_version)
    reports, commits, current = [], [], {}
    for name, variants in concerns().items():
        # A development tree is never a verified release: exact hunk application decides instead.
        outcome = choose_variant(name, variants, version, allow_unverified=True)
        if outcome.state in (UPSTREAM, NOT_APPLICABLE):
            reports.append(ConcernReport(name, outcome.state, outcome.reason))
            continue
        assert outcome.state == PENDING, outcome
        patch = next(p for p in variants if p.file_name == outcome.patch_file)
        state, reason, files = _rebase(src, patch, current)
        if state == REBASED:
            area, test_path, test_source = _upstream_test(name)
            commits.append(_Commit(patch, area, test_path, test_source, files))
            current.update(files)
        reports.append(ConcernReport(name, state, reason))
    if not commits:
        return reports
    patch_paths = _commit_stack(src, base, commits, out / "patches")
    check_patches(src, patch_paths)
    by_name = dict(zip((c.patch.name for c in commits), patch_paths))
    reports = [dataclasses.replace(r, patch_path=by_name.get(r.name)) for r in reports]
    (out / "PR_DESCRIPTION.md").write_text(
        _pr_description(release, base, commits, reports, benchmark), encoding="utf-8"
    )
    return reports
