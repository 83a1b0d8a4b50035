"""The Markdown the kit writes: one PR description per commit, and the cover note for the stack."""

from __future__ import annotations

import re
from pathlib import Path

from dflash.patchtools.upstream import bench, text
from dflash.patchtools.upstream.concerns import CONCERNS
from dflash.patchtools.upstream.placement import test_plan
from dflash.patchtools.upstream.stack import REBASED, Commit

_WORKLOAD_TEXT = {
    "compiled_call": "one call of a compiled `a + 1` (backend `eager`, `fullgraph=True`, CPU)",
    "eager_module_call_after_trace": "one eager call of a 20-module `nn.Sequential` after one `symbolic_trace`",
    "is_exporting": "100 calls of `torch.compiler.is_exporting()`",
    "dynamo_config_read": "100 reads of `torch._dynamo.config.recompile_limit`",
}


def _instruction_table(before: dict[str, int], after: dict[str, int], first: str, second: str) -> list[str]:
    out = [f"| work | {first} | {second} | change |", "|---|---:|---:|---:|"]
    for name, description in _WORKLOAD_TEXT.items():
        b, a = before[name], after[name]
        out.append(f"| {description} | {b:,} | {a:,} | {100 * (a - b) / b:+.2f}% |")
    return out


def _instruction_method() -> str:
    return (
        f"Instruction counts, measured as PyTorch's `benchmarks/dynamo/pr_time_benchmarks` does (prepare "
        f"once, then the minimum over {bench.ITERATIONS} counted runs of the work, garbage collection off, "
        "a fixed hash seed), counted with callgrind "
        "instead of `perf_event_open` (unavailable on the machine used), same tree and build on both sides:"
    )


def _overhead_lines(overhead) -> list[str]:
    data, rows = overhead
    lines = [
        f"Wall-clock calls per second of a small compiled function (backend `{data.get('backend', '?')}`, torch "
        f"{data.get('torch', '?')}), the whole stack against the same build without it, runs alternated; ratio = "
        "median of per-round ratios:",
        "",
        "| threads | without the stack | with the stack | ratio |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {r['plain']:,.0f} | {r['patched']:,.0f} | {bench.ratio_cell(r)} |" for n, r in rows]
    return lines


def pr_description(
    commit: Commit, index: int, total: int, release: str, base: str, rows, verdict, note, counts, overhead, record
) -> str:
    concern = commit.concern
    how = text.how_of(concern, commit.patch, {c.name: c.title for c in CONCERNS})
    out = [
        f"# [{concern.area}] {concern.title}",
        "",
        f"Commit {index + 1} of {total} of a stack.",
        "",
        "## Summary",
        "",
    ]
    out += [concern.problem, "", *[p + "\n" for p in how]]
    out += ["## Test plan", ""] + [f"    {line}" for line in test_plan(commit.concern)] + [""]
    if rows:
        out += [
            f"Run on a {release} tree (base `{base[:12]}`, {record.get('torch', '')}), each side in a fresh "
            f"process: **{verdict}**." + (f" ({note})" if note else ""),
            "",
            text.run_table(rows),
            "",
        ]
        guards = [r["test"] for r in rows if r["without"] == "pass"]
        if guards:
            out += [
                "Passing without this commit too, so on this tree they guard against regressions rather than "
                "show a bug: " + ", ".join(f"`{g}`" for g in guards) + ".",
                "",
            ]
    elif verdict:
        out += [f"Test runs: **{verdict}** ({note}).", ""]
    else:
        out += ["Test runs: not made for this kit (run without `--no-run`).", ""]
    out += ["## BC-breaking notes", ""]
    out += [f"- {line}" for line in concern.bc] if concern.bc else ["None: behaviour in a single thread is unchanged."]
    out += ["", "## Benchmark", ""]
    if counts is not None:
        out += [_instruction_method(), ""] + _instruction_table(*counts, "before", "after") + [""]
    if overhead is not None:
        out += _overhead_lines(overhead) + [""]
    if counts is None and overhead is None:
        out += ["Not measured in this kit (pass `--instructions` and/or `--benchmark-json`).", ""]
    out += ["## Related", ""]
    if concern.related:
        out += [concern.related, ""]
    out += [f"- {line}" for line in text.links(concern, commit.patch)] + [""]
    return "\n".join(out)


def cover_note(release, base, commits: list[Commit], patch_paths: list[Path], reports, record, counts, overhead) -> str:
    out = [
        "# Thread-safe torch.compile and FX: a stack of one PR per concern",
        "",
        f"Made for a {release} tree at `{base[:12]}`. Land bottom to top; each commit builds and passes its "
        "tests on its own.",
        "",
        "## Order",
        "",
    ]
    verdict_of = {c["concern"]: c for c in record["commits"]}
    for i, (commit, path) in enumerate(zip(commits, patch_paths), start=1):
        out.append(f"{i}. `{path.name}`: [{commit.concern.area}] {commit.concern.title}")
    out += ["", "## How this stack relates to open upstream work", ""]
    out += [f"- **{c.concern.title}**: {c.concern.related}" for c in commits if c.concern.related]
    out += ["", "## Tests: without and with each commit", ""]
    if record.get("torch"):
        out += [
            f"Each commit's tests ran twice in fresh processes against {record['torch']}: without the commit "
            "(its tests added, its fix not) and with it.",
            "",
        ]
        if record.get("tree_differs_from_torch_in"):
            out += [
                "The tree's copies of these files differ from that torch's, so the runs used the tree's: "
                + ", ".join(f"`{p}`" for p in record["tree_differs_from_torch_in"]),
                "",
            ]
    out += ["| commit | tests | fail without | pass with | verdict |", "|---|---:|---:|---:|---|"]
    for commit in commits:
        entry = verdict_of[commit.concern.name]
        tests = entry["tests"]
        failing = sum(t["without"] in ("fail", "error") for t in tests)
        passing = sum(t["with"] == "pass" for t in tests)
        verdict = entry["verdict"] or "not run"
        extra = f" ({entry['note']})" if entry["note"] else ""
        out.append(f"| {commit.concern.title} | {len(tests)} | {failing} | {passing} | {verdict}{extra} |")
    out += [""]
    if counts:
        out += ["## Instruction counts per commit", "", _instruction_method(), ""]
        header = ["| work | tree | " + " | ".join(f"+{i}" for i in range(1, len(counts))) + " |"]
        header.append("|---|" + "---:|" * len(counts))
        out += header
        for name, description in _WORKLOAD_TEXT.items():
            out.append(f"| {description} | " + " | ".join(f"{c[name]:,}" for c in counts) + " |")
        out += [""]
    if overhead is not None:
        out += ["## Whole-stack overhead", ""] + _overhead_lines(overhead) + [""]
    others = [r for r in reports if r.state != REBASED]
    if others:
        out += ["## Not in this stack", "", "| change | state | why |", "|---|---|---|"]
        titles = {c.name: c.title for c in CONCERNS}
        out += [f"| {titles.get(r.name, r.name)} | {r.state} | {_reason(r)} |" for r in others]
        out += [""]
    return "\n".join(out)


def _reason(report) -> str:
    """A report's reason in words for upstream readers (the CLI prints the full one)."""
    if report.state == "upstream":
        return "already in this tree"
    if report.state == "not-applicable":
        return "this tree's release does not have the bug"
    return re.sub(r"\b\d{4}-[\w.-]+\.patch\b", "the patch", report.reason).replace("|", "/")
