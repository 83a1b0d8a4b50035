"""The Markdown the kit writes: one PR description per commit, the cover note for the stack, the design
note on torch.compile's thread model, and each design proposal (RFC) with its draft commits."""

from __future__ import annotations

import ast
import importlib.resources
import re
from pathlib import Path

from dflash.patchtools.upstream import bench, text
from dflash.patchtools.upstream.concerns import CONCERNS
from dflash.patchtools.upstream.placement import test_plan, test_source
from dflash.patchtools.upstream.stack import PROPOSED, REBASED, Commit

_WORKLOAD_TEXT = {
    "compiled_call": "one call of a compiled `a + 1` (backend `eager`, `fullgraph=True`, CPU)",
    "compile_after_trace": (
        "compile and first call of a 4-block `nn.Sequential` (backend `eager`) after one `symbolic_trace`"
    ),
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
        f"once, then the minimum over {bench.ITERATIONS} counted runs of the work, each after an uncounted "
        "prepare: `torch._dynamo.reset()` before a compile; garbage collection off, a fixed hash seed), "
        "counted with callgrind instead of `perf_event_open` (unavailable on the machine used), same tree "
        "and build on both sides. A `ContextVar` lookup walks a hash trie keyed by address-based hashes, "
        "so works that read ContextVars (the config read) move by a few percent with memory layout alone:"
    )


def _overhead_lines(overhead) -> list[str]:
    data, rows = overhead
    lines = [
        f"Wall-clock calls per second of a small compiled function (backend `{data.get('backend', '?')}`, "
        f"measured on the torch build `{data.get('torch', '?')}`), the whole stack against the same build "
        "without it, runs alternated; ratio = median of per-round ratios:",
        "",
        "| threads | without the stack | with the stack | ratio |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {r['plain']:,.0f} | {r['patched']:,.0f} | {bench.ratio_cell(r)} |" for n, r in rows]
    return lines


def _stack_lines(result: dict, index: int) -> list[str]:
    if not result.get("stack"):
        return []
    below = f"commits 1 to {index + 1}" if index else "this commit"
    out = [
        f"Stack check: the tests of {below}, on the tree with {below} only: **{result['stack']}**.",
        "",
    ]
    failing = [r for r in result["stack_rows"] if r["outcome"] not in ("pass", "skip")]
    if failing:
        out += ["| test | of commit | outcome |", "|---|---:|---|"]
        out += [f"| `{r['test']}` | {r['commit']} | {r['outcome']} |" for r in failing] + [""]
    return out


def pr_description(
    commit: Commit, index: int, total: int, release: str, base: str, result: dict, counts, overhead, record
) -> str:
    concern = commit.concern
    out = [
        f"# [{concern.area}] {concern.title}",
        "",
        f"Commit {index + 1} of {total} of a stack for main.",
        "",
        "## Summary",
        "",
    ]
    out += [concern.problem, "", *[p + "\n" for p in commit.how]]
    out += ["## Test plan", ""] + [f"    {line}" for line in test_plan(commit.concern)] + [""]
    rows, verdict, note = result.get("rows", []), result.get("verdict", ""), result.get("note", "")
    if rows:
        out += [
            f"Run on main at `{base[:12]}` (version {release}; {record.get('torch', '')}), each side in a "
            f"fresh process, the tree without this commit holding the commits below it: **{verdict}**."
            + (f" ({note})" if note else ""),
            "",
            text.run_table(rows),
            "",
        ]
        guards = [r["test"] for r in rows if r["without"] == "pass"]
        if guards:
            out += [
                "Passing without this commit too, so they guard against regressions rather than show a "
                "bug: " + ", ".join(f"`{g}`" for g in guards) + ".",
                "",
            ]
        out += _stack_lines(result, index)
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
    if counts is None:
        out += [
            "NOT MEASURED: this kit was made without instruction counts, so it is a draft; make it again "
            "with them (the default) before posting.",
            "",
        ]
    out += ["## Related", ""]
    if concern.related:
        out += [concern.related, ""]
    out += [f"- {line}" for line in text.links(concern, commit.patch)] + [""]
    return "\n".join(out)


def cover_note(
    release, base, commits: list[Commit], patch_paths: list[Path], reports, record, counts, overhead, draft_paths
) -> str:
    out = [
        "# Thread-safe torch.compile and FX: a stack of one PR per concern",
        "",
        f"Made for PyTorch main at `{base[:12]}` (version {release}). Land bottom to top; each commit "
        "passes its own tests, and those of the commits below it, with the commits below it only "
        "(the stack check below). `DESIGN.md` describes torch.compile's thread model with the stack: "
        "what is per thread, what stays shared.",
        "",
        "Part of #118260 (Dynamo is not thread safe); see also #105943 (PT2 is not thread safe) and "
        "#136833 (torch.compile from two threads).",
        "",
        "## Order",
        "",
    ]
    verdict_of = {c["concern"]: c for c in record["commits"]}
    for i, (commit, path) in enumerate(zip(commits, patch_paths), start=1):
        out.append(f"{i}. `{path.name}`: [{commit.concern.area}] {commit.concern.title}")
    if draft_paths:
        out += ["", "## Design proposals", ""]
        for name, paths in draft_paths.items():
            titles = [r.name for r in reports if r.state == PROPOSED]
            out.append(
                f"- `rfc/{name}.md`, with its draft commits on top of the stack in `rfc/{name}/` "
                f"({len(paths)} commits; not for landing as they are): " + ", ".join(f"{_title(n)}" for n in titles)
            )
    out += ["", "## How this stack relates to upstream work", ""]
    out += [f"- **{c.concern.title}**: {c.concern.related}" for c in commits if c.concern.related]
    out += ["", "## Tests: without and with each commit, and the stack check", ""]
    if record.get("torch"):
        out += [
            f"Each commit's tests ran in fresh processes against {record['torch']}: without the commit (the "
            "commits below it and its tests added, its fix not) and with it. The stack check ran the tests "
            "of commits 1 to k on the tree with commits 1 to k only, for every k.",
            "",
        ]
        if record.get("tree_differs_from_torch_in"):
            out += [
                "The tree's copies of these files differ from that torch's, so the runs used the tree's: "
                + ", ".join(f"`{p}`" for p in record["tree_differs_from_torch_in"]),
                "",
            ]
    out += [
        "| commit | tests | fail without | pass with | verdict | stack check (tests of 1..k on 1..k) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for i, commit in enumerate(commits, start=1):
        entry = verdict_of[commit.concern.name]
        tests = entry.get("rows", [])
        failing = sum(t["without"] in ("fail", "error") for t in tests)
        passing = sum(t["with"] == "pass" for t in tests)
        verdict = entry.get("verdict") or "not run"
        extra = f" ({entry['note']})" if entry.get("note") else ""
        stack = entry.get("stack") or "not run"
        if entry.get("stack"):
            stack += f" ({len(entry['stack_rows']) + len(tests)} tests of commits 1..{i})"
        out.append(f"| {commit.concern.title} | {len(tests)} | {failing} | {passing} | {verdict}{extra} | {stack} |")
    out += [""]
    if counts:
        out += ["## Instruction counts per commit", "", _instruction_method(), ""]
        header = ["| work | main | " + " | ".join(f"+{i}" for i in range(1, len(counts))) + " |"]
        header.append("|---|" + "---:|" * len(counts))
        out += header
        for name, description in _WORKLOAD_TEXT.items():
            out.append(f"| {description} | " + " | ".join(f"{c[name]:,}" for c in counts) + " |")
        out += [""]
    else:
        out += ["## Instruction counts per commit", "", "NOT MEASURED: a draft kit (see each PR's Benchmark).", ""]
    if overhead is not None:
        out += ["## Whole-stack overhead", ""] + _overhead_lines(overhead) + [""]
    if record.get("lint"):
        out += [
            "## Lint",
            "",
            "Lines the patches add to torch's files that PyTorch's formatter will rewrap (`lintrunner -a`, "
            "then amend each commit):",
            "",
        ]
        out += [f"- {line}" for line in record["lint"]] + [""]
    others = [r for r in reports if r.state not in (REBASED, PROPOSED)]
    if others:
        out += ["## Not in this stack", "", "| change | state | why |", "|---|---|---|"]
        out += [f"| {_title(r.name)} | {r.state} | {_reason(r)} |" for r in others]
        out += [""]
    return "\n".join(out)


def _title(name: str) -> str:
    return next((c.title for c in CONCERNS if c.name == name), name)


def _text(name: str) -> str:
    return (importlib.resources.files("dflash.patchtools") / "upstream_texts" / name).read_text(encoding="utf-8")


def design_note() -> str:
    """``DESIGN.md``: torch.compile's thread model with the stack (``upstream_texts/DESIGN.md``)."""
    return _text("DESIGN.md")


def proposal_text(name: str, chain: list[Commit], paths: list[Path]) -> str:
    """``rfc/<name>.md``: the proposal's text (``upstream_texts/rfc-<name>.md``) with its draft commits
    listed where it says ``{{drafts}}`` and a test source shown where it says ``{{source:PATH}}``."""
    body = _text(f"rfc-{name}.md")
    drafts = [
        f"- `{name}/{path.name}`: [{c.concern.area}] {c.concern.title}; tests: "
        + "; ".join(f"`{line}`" for line in test_plan(c.concern))
        for c, path in zip(chain, paths)
    ]
    body = body.replace("{{drafts}}", "\n".join(drafts))
    return re.sub(r"\{\{source:([\w/.-]+)\}\}", lambda m: "```python\n" + _functions(m.group(1)) + "\n```", body)


def _functions(source: str) -> str:
    """The function definitions of ``upstream_tests/<source>`` (a method edit's new or added body)."""
    text = test_source(source)
    lines = text.splitlines()
    functions = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]
    if not functions:
        return text.rstrip()
    return "\n\n".join("\n".join(lines[f.lineno - 1 : f.end_lineno]) for f in functions)


def _reason(report) -> str:
    """A report's reason in words for upstream readers (the CLI prints the full one)."""
    if report.state == "upstream":
        return "already in main"
    if report.state == "not-applicable":
        return "this tree's release does not have the bug"
    return re.sub(r"\b\d{4}-[\w.-]+\.patch\b", "the patch", report.reason).replace("|", "/")
