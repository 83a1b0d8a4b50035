"""``make_kit``: the stack, its test runs, its numbers and its texts, written into one folder."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from dflash.patching.series import concerns as series_concerns
from dflash.patchtools.upstream import bench, runs, text
from dflash.patchtools.upstream.concerns import CONCERNS, UpstreamConcern, form_for, forms_of
from dflash.patchtools.upstream.documents import cover_note, pr_description
from dflash.patchtools.upstream.placement import test_classes, test_plan, test_source
from dflash.patchtools.upstream.stack import (
    DOES_NOT_APPLY,
    KEPT_OUT,
    REBASED,
    Commit,
    add_tests,
    check_patches,
    commit_stack,
    pick_patch,
    reader,
    rebase,
)
from dflash.patchtools.upstream.tree import UpstreamKitError, git, head_file, release_version, tree_release

# Verdicts of a commit's test runs.
SHOWN = "fails without, passes with"
PASSES_WITHOUT = "PASSES WITHOUT THE FIX"
FAILS_WITH = "FAILS WITH THE FIX"
NOT_RUN = "not run"


@dataclasses.dataclass(frozen=True)
class ConcernReport:
    """What the kit did with one concern.

    Attributes:
        name: the concern (``Patch-Name``).
        state: ``rebased``, ``already-present``, ``does-not-apply``, ``kept-out``, ``upstream`` or
            ``not-applicable``.
        reason: why (for ``rebased``: which patch file applied).
        patch_path: the ``git format-patch`` file written, for ``rebased``.
        verdict: outcome of the test runs (``fails without, passes with`` when shown), "" when not run.
        notes: things a reviewer of the kit should know (CRLF files, patch tried on an unclaimed release).
    """

    name: str
    state: str
    reason: str
    patch_path: Path | None = None
    verdict: str = ""
    notes: tuple[str, ...] = ()


def _test_targets(concern: UpstreamConcern) -> list[tuple[str, list[str]]]:
    """(test file in the tree, classes) the commit's test runs execute."""
    targets = [(p.target, test_classes(test_source(p.source))) for p in concern.tests]
    for edit in concern.edits:
        entry = next((t for t in targets if t[0] == edit.target), None)
        if entry is None:
            targets.append((edit.target, [edit.cls]))
        elif edit.cls not in entry[1]:
            entry[1].append(edit.cls)
    return targets


def _collect(src: Path, version) -> tuple[list[Commit], list[ConcernReport]]:
    variants_of = series_concerns()
    commits, reports, state = [], [], {}
    for forms in forms_of(CONCERNS).values():
        concern = forms[0]
        variants = variants_of.get(concern.name)
        if concern.kept_out:
            reports.append(ConcernReport(concern.name, KEPT_OUT, concern.kept_out))
            continue
        if not variants:
            reports.append(ConcernReport(concern.name, DOES_NOT_APPLY, "no patch of this concern in the series"))
            continue
        outcome, patch, why = pick_patch(concern, variants, version)
        if patch is None:
            reports.append(ConcernReport(concern.name, outcome, why))
            continue
        concern = form_for(forms, patch.diff_text)
        status, reason, fix_files, notes = rebase(patch, reader(src, state))
        notes = [why, *notes] if why else notes
        if status != REBASED:
            reports.append(ConcernReport(concern.name, status, reason, notes=tuple(notes)))
            continue
        try:
            test_files = add_tests(concern, reader(src, {**state, **fix_files}))
        except UpstreamKitError as error:
            reports.append(ConcernReport(concern.name, DOES_NOT_APPLY, str(error), notes=tuple(notes)))
            continue
        commits.append(Commit(concern, patch, fix_files, test_files, notes))
        state.update(fix_files)
        state.update(test_files)
        reports.append(ConcernReport(concern.name, REBASED, reason, notes=tuple(notes)))
    return commits, reports


def _check_text(commits: list[Commit]) -> None:
    stale = {}
    for commit in commits:
        known = commit.patch.description + commit.patch.diff_text + "".join(commit.files.values())
        if found := text.stale_identifiers(commit.concern, known):
            stale[commit.concern.name] = found
    if stale:
        raise UpstreamKitError(
            "the upstream text of these concerns names things their patches no longer have (update "
            f"dflash/patchtools/upstream/concerns.py): {stale}"
        )


def _states(commits: list[Commit]) -> list[dict[str, str]]:
    """The stack's states as changed files: [tree, after commit 1, after commit 2, ...]."""
    states = [{}]
    for commit in commits:
        states.append({**states[-1], **commit.files})
    return states


def _run_pair(commit: Commit, index: int, commits: list[Commit], states, torch_dir, src, python, scratch: Path):
    """(rows, verdict, note): the commit's tests without it and with it, each in a fresh process."""
    without = {**states[index], **commit.test_files}
    with_ = dict(states[index + 1])
    note = ""
    if commit.concern.shows_failure_with:
        later = next((c for c in commits if c.concern.name == commit.concern.shows_failure_with), None)
        if later is None or set(later.fix_files) & set(commit.fix_files):
            return [], NOT_RUN, f"cannot isolate it from {commit.concern.shows_failure_with} on this tree"
        without.update(later.fix_files)
        with_.update(later.fix_files)
        note = f'both runs include the fix of the later commit "{later.concern.title}", which needs this one'
    results = {}
    for label, state in (("without", without), ("with", with_)):
        root = runs.lay_out(state, torch_dir, src / "test", scratch / f"{index}-{label}")
        results[label] = [
            runs.run_tests(python, root, path, classes) for path, classes in _test_targets(commit.concern)
        ]
    errors = [r.error for label in results for r in results[label] if r.error]
    if errors:
        return [], NOT_RUN, f"{note}; {errors[0]}".strip("; ")
    outcome = {label: {k: v for r in results[label] for k, v in r.outcomes.items()} for label in results}
    rows = [
        {
            "test": test,
            "without": outcome["without"].get(test, ("missing", ""))[0],
            "with": outcome["with"].get(test, ("missing", ""))[0],
        }
        for test in sorted(set(outcome["without"]) | set(outcome["with"]))
    ]
    return rows, verdict(rows), note


def verdict(rows: list[dict]) -> str:
    """A commit's verdict from its test rows (``{"test", "without", "with"}``): shown only when every test
    passes with it and at least one fails (or errors) without it."""
    if not rows or any(r["with"] != "pass" for r in rows):
        return FAILS_WITH
    if any(r["without"] in ("fail", "error") for r in rows):
        return SHOWN
    return PASSES_WITHOUT


def _faithfulness(src: Path, commits: list[Commit], torch_dir: Path) -> list[str]:
    """Files the stack changes whose text at HEAD differs from the base torch's copy."""
    paths = {p for c in commits for p in c.fix_files if p.startswith("torch/")}
    differ = []
    for path in sorted(paths):
        installed = torch_dir / path.removeprefix("torch/")
        if not installed.is_file() or installed.read_text(encoding="utf-8") != head_file(src, path):
            differ.append(path)
    return differ


def make_kit(
    src: Path,
    out: Path,
    *,
    python: str | None = None,
    run: bool = True,
    benchmark_json: Path | None = None,
    instructions: bool = False,
) -> list[ConcernReport]:
    """Write the upstream stack for the PyTorch checkout ``src`` into ``out``; returns what became of each concern.

    Writes ``out/patches/NNNN-*.patch`` (one ``git format-patch`` commit per concern), ``out/pr/NNNN-*.md``
    (its PR description), ``out/COVER.md`` (order, relation to open upstream work, the test-run table)
    and ``out/runs.json`` (every test's outcome without and with its commit).

    Args:
        src: root of a PyTorch git checkout (only read).
        out: an empty or new folder.
        python: interpreter whose torch runs the tests (default: this one); its compiled parts are used
            when ``src`` is not built in place.
        run: run each commit's tests without and with it (fresh processes).
        benchmark_json: output of ``benchmarks/patch_overhead.py --json`` (whole-stack overhead).
        instructions: count instructions per commit with callgrind (slow: minutes per state).

    Raises:
        UpstreamKitError: ``src`` is not a git checkout with a torch version, ``out`` holds patches, git
            fails, the kit's own text is stale or would leak project-internal text, or a produced patch
            fails ``git apply --check``.
    """
    src = src.resolve()
    if not (src / "torch").is_dir():
        raise UpstreamKitError(f"{src}: no torch/ folder; pass the root of a PyTorch checkout")
    if list((out / "patches").glob("*.patch")):
        raise UpstreamKitError(f"{out / 'patches'} already holds .patch files: pass an empty or new --out folder")
    overhead = bench.overhead_rows(benchmark_json) if benchmark_json is not None else None
    base = git(src, "rev-parse", "--verify", "HEAD^{commit}").strip()
    release = tree_release(src)
    commits, reports = _collect(src, release_version(release, src))
    if not commits:
        return reports
    _check_text(commits)
    titles = {c.name: c.title for c in CONCERNS}
    messages = []
    for commit in commits:
        how = text.how_of(commit.concern, commit.patch, titles)
        link_lines = text.links(commit.concern, commit.patch)
        messages.append(
            text.commit_message(
                commit.concern, how, test_plan(commit.concern), link_lines, [e.why for e in commit.concern.edits]
            )
        )
    leaks = {f"commit {i + 1}": found for i, m in enumerate(messages) if (found := text.internal_references(m))}
    if leaks:
        raise UpstreamKitError(f"the commit messages would carry project-internal text: {leaks}")
    patch_paths = commit_stack(src, base, [(c.files, m) for c, m in zip(commits, messages)], out / "patches")
    check_patches(src, patch_paths)

    python = python or sys.executable
    states = _states(commits)
    record = {"release": release, "base": base, "commits": []}
    verdicts: dict[str, tuple[list, str, str]] = {}
    instruction_counts: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        torch_dir, torch_origin = runs.base_torch(src, python) if (run or instructions) else (None, "")
        if torch_dir is not None:
            record["torch"] = torch_origin
            record["tree_differs_from_torch_in"] = _faithfulness(src, commits, torch_dir)
        if run:
            for i, commit in enumerate(commits):
                verdicts[commit.concern.name] = _run_pair(commit, i, commits, states, torch_dir, src, python, scratch)
        if instructions:
            for i, state in enumerate(states):
                root = runs.lay_out(state, torch_dir, src / "test", scratch / f"bench-{i}")
                instruction_counts.append(bench.count_instructions(python, root))
    by_name = dict(zip((c.concern.name for c in commits), patch_paths))
    reports = [
        dataclasses.replace(r, patch_path=by_name.get(r.name), verdict=verdicts.get(r.name, ([], "", ""))[1])
        for r in reports
    ]
    documents = {}
    for i, (commit, path) in enumerate(zip(commits, patch_paths)):
        rows, verdict, note = verdicts.get(commit.concern.name, ([], "", ""))
        record["commits"].append(
            {"concern": commit.concern.name, "patch": path.name, "verdict": verdict, "note": note, "tests": rows}
        )
        counts = (instruction_counts[i], instruction_counts[i + 1]) if instruction_counts else None
        documents[f"pr/{path.stem}.md"] = pr_description(
            commit, i, len(commits), release, base, rows, verdict, note, counts, overhead, record
        )
    documents["COVER.md"] = cover_note(
        release, base, commits, patch_paths, reports, record, instruction_counts, overhead
    )
    documents["runs.json"] = json.dumps({**record, "instruction_counts": instruction_counts}, indent=2) + "\n"
    leaks = {name: found for name, body in documents.items() if (found := text.internal_references(body))}
    leaks.update(
        {
            p.name: found
            for p in patch_paths
            if (found := text.internal_references(text.patch_text_to_check(p.read_text(encoding="utf-8"))))
        }
    )
    if leaks:
        raise UpstreamKitError(f"the kit would write project-internal text: {leaks}")
    for name, body in documents.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(body, encoding="utf-8")
    return reports
