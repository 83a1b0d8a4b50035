"""``make_kit``: the stack, its test runs, its numbers and its texts, written into one folder."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from dflash.patching.series import concerns as series_concerns
from dflash.patchtools.upstream import bench, lint, runs, text
from dflash.patchtools.upstream.concerns import CONCERNS, UpstreamConcern, form_for, forms_of
from dflash.patchtools.upstream.documents import cover_note, design_note, pr_description, proposal_text
from dflash.patchtools.upstream.placement import test_classes, test_plan, test_source
from dflash.patchtools.upstream.stack import (
    DOES_NOT_APPLY,
    KEPT_OUT,
    PROPOSED,
    REBASED,
    Commit,
    add_tests,
    check_patches,
    commit_stack,
    pick_patch,
    reader,
    rebase,
)
from dflash.patchtools.upstream.tree import (
    UpstreamKitError,
    git,
    head_file,
    refuse_release_tree,
    release_version,
    tree_release,
)

# Verdicts of a commit's test runs.
SHOWN = "fails without, passes with"
PASSES_WITHOUT = "PASSES WITHOUT THE FIX"
FAILS_WITH = "FAILS WITH THE FIX"
NOT_RUN = "not run"
# Verdicts of the stack check: the tests of commits 1..k on the tree with commits 1..k only.
STACK_PASSES = "passes"
STACK_FAILS = "FAILS"


@dataclasses.dataclass(frozen=True)
class ConcernReport:
    """What the kit did with one concern.

    Attributes:
        name: the concern (``Patch-Name``).
        state: ``rebased``, ``proposed`` (drafted for a design proposal), ``already-present``,
            ``does-not-apply``, ``kept-out``, ``upstream`` or ``not-applicable``.
        reason: why (for ``rebased``: which patch file applied).
        patch_path: the ``git format-patch`` file written, for ``rebased``.
        verdict: outcome of the test runs (``fails without, passes with`` when shown), "" when not run.
        stack: outcome of the stack check (``passes``: the tests of this commit and of every commit
            below it pass on the tree with those commits only), "" when not run.
        notes: things a reviewer of the kit should know (CRLF files, patch tried on an unclaimed release).
    """

    name: str
    state: str
    reason: str
    patch_path: Path | None = None
    verdict: str = ""
    stack: str = ""
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


def _tidy(fix_files: dict[str, str], read) -> dict[str, str]:
    """The patch's new texts with the imports it adds tidied as PyTorch's lint wants them."""
    return {p: lint.tidy_imports(t, read(p)) if p.endswith(".py") else t for p, t in fix_files.items()}


def _commit(concern, patch, notes, read, reports) -> Commit | None:
    """``patch`` rebased on the files ``read`` gives, with its tests; None (and a report) if it cannot be."""
    status, reason, fix_files, rebase_notes = rebase(patch, read)
    notes = [*notes, *rebase_notes]
    if status != REBASED:
        reports.append(ConcernReport(concern.name, status, reason, notes=tuple(notes)))
        return None
    fix_files = _tidy(fix_files, read)
    try:
        test_files = add_tests(concern, lambda path: fix_files[path] if path in fix_files else read(path))
    except UpstreamKitError as error:
        reports.append(ConcernReport(concern.name, DOES_NOT_APPLY, str(error), notes=tuple(notes)))
        return None
    return Commit(concern, patch, fix_files, test_files, notes)


def _collect(src: Path, version) -> tuple[list[Commit], dict[str, list[Commit]], list[ConcernReport]]:
    """(the stack's commits, each design proposal's draft commits on top of the stack, what became of
    every concern)."""
    variants_of = series_concerns()
    if unknown := sorted(set(variants_of) - set(forms_of(CONCERNS))):
        raise UpstreamKitError(
            f"no upstream text for the series' concern(s) {unknown}: add an UpstreamConcern to "
            "dflash/patchtools/upstream/concerns.py (kept_out with the reason when it stays out)"
        )
    commits, reports, state = [], [], {}
    proposed: list[tuple[UpstreamConcern, object, list[str]]] = []
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
        notes = [why] if why else []
        if concern.proposal:
            proposed.append((concern, patch, notes))
            continue
        commit = _commit(concern, patch, notes, reader(src, state), reports)
        if commit is None:
            continue
        commits.append(commit)
        state.update(commit.files)
        reports.append(
            ConcernReport(concern.name, REBASED, f"{patch.file_name} applies exactly", notes=tuple(commit.notes))
        )
    # A proposal's changes are drafted on top of the whole stack, in landing order.
    drafts: dict[str, list[Commit]] = {}
    for concern, patch, notes in proposed:
        commit = _commit(concern, patch, notes, reader(src, state), reports)
        if commit is None:
            continue
        drafts.setdefault(concern.proposal, []).append(commit)
        state.update(commit.files)
        reason = f"sent as a design proposal (rfc/{concern.proposal}.md), drafted on top of the stack"
        reports.append(ConcernReport(concern.name, PROPOSED, reason, notes=tuple(commit.notes)))
    order = {c.name: i for i, c in enumerate(CONCERNS)}
    reports.sort(key=lambda r: order.get(r.name, len(order)))
    return commits, drafts, reports


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


def _merged_targets(concerns: list[UpstreamConcern]) -> list[tuple[str, list[str]]]:
    """(test file, classes) that run the tests of all of ``concerns``, one entry per file."""
    merged: dict[str, list[str]] = {}
    for concern in concerns:
        for path, classes in _test_targets(concern):
            merged.setdefault(path, [])
            merged[path] += [c for c in classes if c not in merged[path]]
    return list(merged.items())


def _outcomes(results: list[runs.RunResult]) -> dict[str, tuple[str, str]]:
    return {k: v for r in results for k, v in r.outcomes.items()}


def _run_stack(commits: list[Commit], states, torch_dir, src, python, scratch: Path) -> list[dict]:
    """Per commit k (from 0): its tests without it (the tree with commits before it and its tests added)
    and the tests of commits 0..k on the tree with commits 0..k only, each side in fresh processes.

    Returns per commit ``{"rows", "verdict", "note", "stack_rows", "stack"}``: ``rows`` its own tests
    without and with it, ``stack_rows`` the tests of the commits below it on the same tree as its own
    ``with`` side, ``stack`` whether all of those pass there.
    """
    out = []
    for k, commit in enumerate(commits):
        without_root = runs.lay_out(
            {**states[k], **commit.test_files}, torch_dir, src / "test", scratch / f"{k}-without"
        )
        with_root = runs.lay_out(states[k + 1], torch_dir, src / "test", scratch / f"{k}-with")
        without = [
            runs.run_tests(python, without_root, path, classes) for path, classes in _test_targets(commit.concern)
        ]
        with_ = [
            runs.run_tests(python, with_root, path, classes)
            for path, classes in _merged_targets([c.concern for c in commits[: k + 1]])
        ]
        errors = [r.error for r in without + with_ if r.error]
        if errors:
            out.append({"rows": [], "verdict": NOT_RUN, "note": errors[0], "stack_rows": [], "stack": ""})
            continue
        own = {cls for _, classes in _test_targets(commit.concern) for cls in classes}
        before, after = _outcomes(without), _outcomes(with_)
        mine = sorted(t for t in set(before) | set(after) if t.split(".")[0] in own)
        rows = [
            {"test": t, "without": before.get(t, ("missing", ""))[0], "with": after.get(t, ("missing", ""))[0]}
            for t in mine
        ]
        stack_rows = [
            {"test": t, "commit": next(i + 1 for i, c in enumerate(commits) if _owns(c, t)), "outcome": after[t][0]}
            for t in sorted(set(after) - set(mine))
        ]
        stack = (
            STACK_PASSES
            if all(r["with"] == "pass" for r in rows) and all(r["outcome"] in ("pass", "skip") for r in stack_rows)
            else STACK_FAILS
        )
        out.append({"rows": rows, "verdict": verdict(rows), "note": "", "stack_rows": stack_rows, "stack": stack})
    return out


def _owns(commit: Commit, test_id: str) -> bool:
    return any(test_id.split(".")[0] in classes for _, classes in _test_targets(commit.concern))


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


def _messages(commits: list[Commit], below: list[Commit] = ()) -> list[str]:
    """Each commit's message (its how paragraphs kept on it); ``below``: commits under ``commits``."""
    titles = {c.concern.name: c.concern.title for c in [*below, *commits]}
    messages = []
    for commit in commits:
        how = commit.how = text.how_of(commit.concern, commit.patch, titles)
        messages.append(
            text.commit_message(
                commit.concern,
                how,
                test_plan(commit.concern),
                text.links(commit.concern, commit.patch),
                [e.why for e in commit.concern.edits],
            )
        )
    return messages


def _lint(commits: list[Commit], src: Path, drafts: int = 0) -> list[str]:
    """PyTorch's lint on every commit: what the kit writes itself (the test files) must pass; what the
    patches add to torch's files is returned, for ``lintrunner -a`` to reformat (none on main). The last
    ``drafts`` commits (a proposal's drafts, for discussion) are checked on their test files only.

    Raises:
        UpstreamKitError: a test file the kit adds or changes would fail.
    """
    fatal, notes, state = [], [], {}
    for i, commit in enumerate(commits):
        for path, new in commit.files.items():
            old = state[path] if path in state else head_file(src, path)
            if path.startswith("test/"):
                fatal += lint.problems(path, old, new)
            elif i < len(commits) - drafts:
                notes += lint.problems(path, old, new)
        state.update(commit.files)
    if fatal:
        raise UpstreamKitError(
            "the test files of the commits would fail PyTorch's lint (fix the sources under "
            "dflash/patchtools/upstream_tests/): " + "; ".join(fatal)
        )
    return notes


def make_kit(
    src: Path,
    out: Path,
    *,
    python: str | None = None,
    run: bool = True,
    benchmark_json: Path | None = None,
    instructions: bool = False,
) -> list[ConcernReport]:
    """Write the upstream stack for the PyTorch main checkout ``src`` into ``out``; returns what became of
    each concern.

    Writes ``out/patches/NNNN-*.patch`` (one ``git format-patch`` commit per concern), ``out/pr/NNNN-*.md``
    (its PR description), ``out/COVER.md`` (order, relation to open upstream work, the test-run table),
    ``out/DESIGN.md`` (torch.compile's thread model with the stack), ``out/rfc/<proposal>.md`` and
    ``out/rfc/<proposal>/NNNN-*.patch`` (each design proposal and its draft commits, on top of the
    stack) and ``out/runs.json`` (every test's outcome without and with its commit, the stack check).

    Args:
        src: root of a PyTorch git checkout of main (``version.txt`` of a development version, such as
            ``2.16.0a0``; only read).
        out: an empty or new folder.
        python: interpreter whose torch runs the tests (default: this one); its compiled parts are used
            when ``src`` is not built in place.
        run: run each commit's tests without and with it, and the stack check: the tests of commits
            1..k on the tree with commits 1..k only, for every k (fresh processes).
        benchmark_json: output of ``benchmarks/patch_overhead.py --json`` (whole-stack overhead).
        instructions: count instructions per commit with callgrind (slow: minutes per state).

    Raises:
        UpstreamKitError: ``src`` is not a git checkout with a torch version, is a release tree, ``out``
            holds patches, git fails, the kit's own text is stale or would leak project-internal or
            release-bound text, a commit would fail PyTorch's lint, or a produced patch fails
            ``git apply --check``.
    """
    src = src.resolve()
    if not (src / "torch").is_dir():
        raise UpstreamKitError(f"{src}: no torch/ folder; pass the root of a PyTorch checkout")
    if list((out / "patches").glob("*.patch")):
        raise UpstreamKitError(f"{out / 'patches'} already holds .patch files: pass an empty or new --out folder")
    overhead = bench.overhead_rows(benchmark_json) if benchmark_json is not None else None
    base = git(src, "rev-parse", "--verify", "HEAD^{commit}").strip()
    release = tree_release(src)
    version = release_version(release, src)
    refuse_release_tree(release, src)
    commits, drafts, reports = _collect(src, version)
    if not commits:
        return reports
    all_commits = commits + [c for chain in drafts.values() for c in chain]
    _check_text(all_commits)
    lint_notes = _lint(all_commits, src, drafts=len(all_commits) - len(commits))
    messages = _messages(commits)
    draft_messages = {name: _messages(chain, commits) for name, chain in drafts.items()}
    every_message = messages + [m for chain in draft_messages.values() for m in chain]
    leaks = {f"commit {i + 1}": found for i, m in enumerate(every_message) if (found := text.internal_references(m))}
    if leaks:
        raise UpstreamKitError(f"the commit messages would carry project-internal or release-bound text: {leaks}")
    patch_paths, head = commit_stack(src, base, [(c.files, m) for c, m in zip(commits, messages)], out / "patches")
    draft_paths: dict[str, list[Path]] = {}
    for name, chain in drafts.items():
        draft_paths[name], _ = commit_stack(
            src, head, [(c.files, m) for c, m in zip(chain, draft_messages[name])], out / "rfc" / name
        )
    check_patches(src, patch_paths + [p for paths in draft_paths.values() for p in paths])

    python = python or sys.executable
    states = _states(commits)
    record = {"release": release, "base": base, "commits": [], "lint": lint_notes}
    stack_runs: list[dict] = []
    instruction_counts: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        torch_dir, torch_origin = runs.base_torch(src, python) if (run or instructions) else (None, "")
        if torch_dir is not None:
            record["torch"] = torch_origin
            record["tree_differs_from_torch_in"] = _faithfulness(src, commits, torch_dir)
        if run:
            stack_runs = _run_stack(commits, states, torch_dir, src, python, scratch)
        if instructions:
            for i, state in enumerate(states):
                root = runs.lay_out(state, torch_dir, src / "test", scratch / f"bench-{i}")
                instruction_counts.append(bench.count_instructions(python, root))
    ran = dict(zip((c.concern.name for c in commits), stack_runs))
    by_name = dict(zip((c.concern.name for c in commits), patch_paths))
    reports = [
        dataclasses.replace(
            r,
            patch_path=by_name.get(r.name),
            verdict=ran.get(r.name, {}).get("verdict", ""),
            stack=ran.get(r.name, {}).get("stack", ""),
        )
        for r in reports
    ]
    documents = {}
    for i, (commit, path) in enumerate(zip(commits, patch_paths)):
        result = ran.get(commit.concern.name, {"rows": [], "verdict": "", "note": "", "stack_rows": [], "stack": ""})
        record["commits"].append({"concern": commit.concern.name, "patch": path.name, **result})
        counts = (instruction_counts[i], instruction_counts[i + 1]) if instruction_counts else None
        documents[f"pr/{path.stem}.md"] = pr_description(
            commit, i, len(commits), release, base, result, counts, overhead, record
        )
    documents["COVER.md"] = cover_note(
        release, base, commits, patch_paths, reports, record, instruction_counts, overhead, draft_paths
    )
    documents["DESIGN.md"] = design_note()
    for name, chain in drafts.items():
        documents[f"rfc/{name}.md"] = proposal_text(name, chain, draft_paths[name])
    record["proposals"] = {name: [p.name for p in paths] for name, paths in draft_paths.items()}
    documents["runs.json"] = json.dumps({**record, "instruction_counts": instruction_counts}, indent=2) + "\n"
    leaks = {name: found for name, body in documents.items() if (found := text.internal_references(body))}
    leaks.update(
        {
            p.name: found
            for p in patch_paths + [p for paths in draft_paths.values() for p in paths]
            if (found := text.internal_references(text.patch_text_to_check(p.read_text(encoding="utf-8"))))
        }
    )
    if leaks:
        raise UpstreamKitError(f"the kit would write project-internal or release-bound text: {leaks}")
    for name, body in documents.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(body, encoding="utf-8")
    return reports
