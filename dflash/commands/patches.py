"""``dflash patches ...``: the thread-safety patch series from the command line.

``status`` (is it active here, and what became of each concern), ``verify`` (the bug-class checks,
plain vs patched; ``--record`` writes a verification record), ``coverage`` (which torch releases
the series covers), ``refresh`` (regenerate each release's variants), ``build-wheel`` (a torch
wheel with the series built in), ``upstream`` (a PyTorch PR stack of it, ``docs/upstream-kit.md``)
and ``pytorch-tests`` (PyTorch's own tests of an exact release tag, plain vs patched).
"""

from __future__ import annotations

import json
import sys

from dflash.commands import COMMON, positive
from dflash.patchtools import MissingExtra
from dflash.patchtools.verify.catalogue import BUG_CLASSES, CHECK_SECONDS


def _status(args) -> int:
    from dflash.patching.startup import env_problem
    from dflash.patching.status import collect

    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"torch {report['torch_version']}; startup hook {'active' if report['hook_active'] else 'NOT active'}")
        problem = env_problem()
        if problem:
            print(f"  {problem}")
        width = max(len(p["name"]) for p in report["patches"])
        reasons = [p["reason"] for p in report["patches"]]
        # A long reason shared by several patches (torch imported first, hook disabled) is printed once.
        shared = [r for r in dict.fromkeys(reasons) if reasons.count(r) > 1 and len(r) > 80]
        for patch in report["patches"]:
            reason = patch["reason"]
            shown = f"see [{shared.index(reason) + 1}] below" if reason in shared else reason
            print(f"  {patch['name']:<{width}}  {patch['state']:<14}  {shown}")
        for number, reason in enumerate(shared, start=1):
            print(f"[{number}] {reason}")
        print(_cache_text(report["cache"]))
    return 1 if any(p["state"] == "failed" for p in report["patches"]) else 0


def _cache_text(cache: dict) -> str:
    """The cache lines of ``dflash patches status`` (see ``dflash.patching.cache.describe``)."""
    lines = [f"patch cache {cache['directory']}: {cache['state']}"]
    if cache["state"] == "ok":
        lines[0] += f", {cache['entries']} entries"
    if cache["detail"]:
        lines[0] += f" ({cache['detail']})"
    for name, fault in cache["faults"].items():
        done = "recomputed and rewritten" if fault["rewritten"] else "recomputed (could not be rewritten)"
        lines.append(f"  entry {name}: {fault['why']}; {done} by this process")
    if cache["corrupt"]:
        count = len(cache["corrupt"])
        lines.append(
            f"  {count} {'entry does' if count == 1 else 'entries do'} not verify (corrupt): never used, "
            "recomputed and rewritten when needed"
        )
    if cache.get("stale"):
        lines.append(
            f"  {len(cache['stale'])} entries of another dflash version (harmless: not read by this one, "
            "removed when the cache passes its size limit)"
        )
    return "\n".join(lines)


def _verify(args) -> int:
    import torch

    from dflash.patchtools.verify.catalogue import BUG_CLASSES, applies_to
    from dflash.patchtools.verify.runner import run_checks_subprocess

    classes = [c.upper() for c in args.classes] or list(BUG_CLASSES)
    unknown = [c for c in classes if c not in BUG_CLASSES]
    if unknown:
        print(
            f"dflash patches verify: unknown bug class {', '.join(unknown)}; choose from "
            f"{' '.join(BUG_CLASSES)} or give none for all",
            file=sys.stderr,
        )
        return 2
    if args.record and classes != list(BUG_CLASSES):
        print("dflash patches verify: --record needs every bug class; give no CLASS arguments", file=sys.stderr)
        return 2
    runs = [(c, patched) for c in classes for patched in (False, True)]
    print(
        f"torch {torch.__version__}: {len(classes)} bug classes x (plain, patched), "
        f"{args.seconds:g} s each, fresh interpreters, {args.jobs} at a time"
    )
    results = run_checks_subprocess(runs, seconds=args.seconds, jobs=args.jobs)
    print(f"{'class':<6}{'calls plain':>12}{'fail plain':>12}{'calls patched':>15}{'fail patched':>14}  verdict")
    ok, verdicts = True, {}
    for c in classes:
        plain, patched = results[(c, False)], results[(c, True)]
        present = applies_to(c, torch.__version__)
        if patched.failures:
            verdict, ok = "FAILS PATCHED: " + (patched.example_error or "")[:80], False
        elif plain.failures:
            verdict = "fixed" if present is True else f"fixed (plain failed, though the catalogue says: {present})"
        elif present is not True:
            verdict = f"not present in this torch ({present})"
        else:
            verdict = "not reproduced on plain torch this run (try --seconds 10)"
        verdicts[c] = verdict
        print(f"{c:<6}{plain.calls:>12}{plain.failures:>12}{patched.calls:>15}{patched.failures:>14}  {verdict}")
    if args.record:
        return _record(torch.__version__, args.seconds, results, verdicts, ok)
    return 0 if ok else 1


def _record(torch_version: str, seconds: float, results, verdicts, ok: bool) -> int:
    from dflash.patchtools.verify.records import make_record, write_record

    if not ok:
        print("not recorded: a check failed with the series applied", file=sys.stderr)
        return 1
    try:
        record = make_record(torch_version, seconds, results, verdicts)
    except ValueError as error:
        print(f"not recorded: {error}", file=sys.stderr)
        return 1
    path = write_record(record)
    print(f"recorded {path}: " + ", ".join(f"{n} ({p['file']})" for n, p in record["patches"].items()))
    return 0


def _coverage(args) -> int:
    import os
    from pathlib import Path

    from dflash.patchtools.coverage import collect, installed_torch

    sources = args.sources or os.environ.get("DFLASH_TORCH_SOURCES")
    try:
        report = collect(Path(sources) if sources else None)
    except ValueError as error:
        given = f"--sources {args.sources}" if args.sources else f"DFLASH_TORCH_SOURCES={sources}"
        print(f"dflash patches coverage: {given}: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"releases": [c.as_dict() for c in report]}, indent=2))
        return 0
    print(f"  {'release':<12} {'state':<12} {'records':<19} reason")
    for item in report:
        match = "records match" if item.records_match else "no matching record"
        dev = " (dev tree)" if item.dev else ""
        mark = "*" if item.installed else " "
        print(f"{mark} {item.version:<12} {item.state:<12} {match:<19}{dev} {item.reason}".rstrip())
    installed = installed_torch()
    print(
        (f"* = installed torch {installed[0]}; " if installed is not None else "")
        + "verified: the variants fit and its record matches; fits: they fit, no matching record; unsupported: "
        "see reason; records: does patches/records/<release>.json name exactly today's diffs"
    )
    return 0


def _refresh(args) -> int:
    try:
        from dflash.patchtools.refresh import main
    except MissingExtra as error:
        print(f"dflash patches refresh: {error}", file=sys.stderr)
        return 1
    return main(["--sources", args.sources, *(["--check"] if args.check else []), *args.concerns])


def _build_wheel(args) -> int:
    import sys
    from pathlib import Path

    from dflash.patchtools.wheel import WheelBuildError, build_wheel

    try:
        built = build_wheel(
            torch_wheel=Path(args.torch_wheel) if args.torch_wheel else None,
            from_installed=args.from_installed,
            out_dir=Path(args.out),
        )
    except WheelBuildError as error:
        print(f"dflash patches build-wheel: {error}", file=sys.stderr)
        return 1
    print(f"wrote {built.path} (torch.__version__ {built.torch_version})")
    for name, patch_file in built.applied.items():
        print(f"  built in   {name} ({patch_file})")
    for name, why in built.not_applied.items():
        print(f"  left out   {name} ({why})")
    return 0


def _upstream(args) -> int:
    from pathlib import Path

    from dflash.patchtools.upstream import DOES_NOT_APPLY, SHOWN, STACK_FAILS, UpstreamKitError, make_kit

    try:
        reports = make_kit(
            Path(args.pytorch_src),
            Path(args.out),
            python=args.python,
            run=not args.no_run,
            benchmark_json=Path(args.benchmark_json) if args.benchmark_json else None,
            instructions=not args.no_instructions,
        )
    except UpstreamKitError as error:
        print(f"dflash patches upstream: {error}", file=sys.stderr)
        return 1
    width = max(len(r.name) for r in reports)
    for report in reports:
        print(f"  {report.name:<{width}}  {report.state:<16}  {report.patch_path or report.reason}")
        if report.verdict:
            print(f"  {'':<{width}}  tests: {report.verdict}")
        if report.stack:
            print(f"  {'':<{width}}  stack check (its tests and those below it, with them only): {report.stack}")
        for note in report.notes:
            print(f"  {'':<{width}}  note: {note}")
    if any(r.patch_path for r in reports):
        out = Path(args.out)
        print(
            f"wrote {out / 'COVER.md'} and {out / 'pr'}/*.md; apply the stack with "
            f"`git am --keep-non-patch {out / 'patches'}/*.patch` (keeps the [area] title prefixes)"
        )
        if any("CRLF" in note for r in reports for note in r.notes):
            print("the stack edits files with CRLF line endings: add --keep-cr to git am")
    unshown = [r.name for r in reports if r.patch_path and not args.no_run and r.verdict != SHOWN]
    if unshown:
        print(f"not shown failing without and passing with their fix: {', '.join(unshown)}", file=sys.stderr)
    broken = [r.name for r in reports if r.stack == STACK_FAILS]
    if broken:
        print(f"the stack check failed at: {', '.join(broken)}", file=sys.stderr)
    if any(r.patch_path for r in reports) and args.no_instructions:
        print("made without instruction counts: the PR descriptions say NOT MEASURED (a draft)", file=sys.stderr)
    return 1 if unshown or broken or any(r.state == DOES_NOT_APPLY for r in reports) else 0


def _pytorch_tests(args) -> int:
    import os
    from pathlib import Path

    from dflash.patchtools.pytorch_tests.environment import VenvError
    from dflash.patchtools.pytorch_tests.runner import run_tests
    from dflash.patchtools.pytorch_tests.selections import SELECTIONS, Entry

    if args.file:
        entries = tuple(Entry(path, args.keyword) for path in args.file)
    elif args.keyword is not None:
        print("dflash patches pytorch-tests: -k narrows the --file entries; give --file too", file=sys.stderr)
        return 2
    else:
        entries = SELECTIONS[args.selection]
    if args.list:
        print("\n".join(entry.label for entry in entries))
        return 0
    cache = Path(args.cache or os.environ.get("DFLASH_PYTORCH_TESTS") or Path.home() / ".cache/dflash/pytorch-tests")
    try:
        return run_tests(
            args.tag,
            entries,
            cache=cache,
            mirror=args.mirror,
            jobs=args.jobs,
            test_timeout_s=args.test_timeout,
            file_timeout_s=args.file_timeout,
            out=Path(args.out) if args.out else None,
        )
    except (ValueError, OSError, VenvError) as error:
        print(f"dflash patches pytorch-tests: {error}", file=sys.stderr)
        return 1


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "patches", parents=[COMMON], help="inspect and check the torch thread-safety patch series"
    )
    commands = parser.add_subparsers(dest="patches_command", required=True, metavar="COMMAND")

    status = commands.add_parser("status", parents=[COMMON], help="torch version, hook state, and each patch's state")
    status.add_argument("--json", action="store_true", help="print JSON: torch_version, hook_active, patches")
    status.set_defaults(func=_status)

    verify = commands.add_parser(
        "verify",
        parents=[COMMON],
        help="two-thread check of each bug class, with and without the patches, in fresh interpreters",
    )
    verify.add_argument(
        "classes", nargs="*", metavar="CLASS", help=f"bug classes to check (default: all, {', '.join(BUG_CLASSES)})"
    )
    verify.add_argument(
        "--seconds", type=positive(float), default=CHECK_SECONDS, help="race duration per check (default %(default)s)"
    )
    verify.add_argument("--jobs", type=positive(int), default=2, help="checks run at once (default %(default)s)")
    verify.add_argument(
        "--record",
        action="store_true",
        help="when every check passes patched, write patches/records/<release>.json (what the engine trusts)",
    )
    verify.set_defaults(func=_verify)

    coverage = commands.add_parser(
        "coverage",
        parents=[COMMON],
        help="per torch release from 2.5 on: verified / fits / unsupported, and whether records match",
    )
    coverage.add_argument(
        "--json",
        action="store_true",
        help='print {"releases": [{version, state, records_match, reason, dev, installed}]}',
    )
    coverage.add_argument(
        "--sources", metavar="DIR", help="<version>/torch trees to check hunks against (default $DFLASH_TORCH_SOURCES)"
    )
    coverage.set_defaults(func=_coverage)

    refresh = commands.add_parser(
        "refresh",
        parents=[COMMON],
        help="regenerate each release's variant of every concern from its source diff (three-way merge)",
    )
    refresh.add_argument(
        "--sources", required=True, metavar="DIR", help="<version>/torch trees (scripts/fetch_torch_sources.py)"
    )
    refresh.add_argument("--check", action="store_true", help="write nothing; exit 1 if the generated files are stale")
    refresh.add_argument("concerns", nargs="*", help="concerns to refresh (default: all)")
    refresh.set_defaults(func=_refresh)

    build = commands.add_parser(
        "build-wheel",
        parents=[COMMON],
        help="rebuild a torch wheel with the patch series built in (no startup hook needed)",
    )
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--torch-wheel", metavar="PATH", help="the torch .whl file to rebuild (only read)")
    source.add_argument("--from-installed", action="store_true", help="rebuild the torch installed here")
    build.add_argument("--out", default="dist", metavar="DIR", help="where to write the new wheel (default dist)")
    build.set_defaults(func=_build_wheel)

    upstream = commands.add_parser(
        "upstream",
        parents=[COMMON],
        help="write a PyTorch stack for a main checkout: one format-patch commit per concern with its tests, PR "
        "descriptions, a cover note, a design note, design proposals",
    )
    upstream.add_argument(
        "--pytorch-src", required=True, metavar="DIR", help="root of a PyTorch main git checkout (only read)"
    )
    upstream.add_argument(
        "--out", default="upstream-kit", metavar="DIR", help="where to write the kit (default upstream-kit)"
    )
    upstream.add_argument(
        "--python",
        metavar="PATH",
        help="interpreter whose torch runs the tests when the checkout is not built in place (default: this one)",
    )
    upstream.add_argument("--no-run", action="store_true", help="do not run each commit's tests without and with it")
    upstream.add_argument(
        "--no-instructions",
        action="store_true",
        help="do not count instructions per commit with callgrind (minutes per commit); the kit is then a draft",
    )
    upstream.add_argument("--benchmark-json", metavar="PATH", help="output of benchmarks/patch_overhead.py --json")
    upstream.set_defaults(func=_upstream)

    from dflash.patchtools.pytorch_tests.selections import SELECTIONS
    from dflash.patchtools.pytorch_tests.trees import NEWEST, TREES

    tests = commands.add_parser(
        "pytorch-tests",
        parents=[COMMON],
        help="PyTorch's own tests of an exact release tag, plain vs patched, outcome by outcome",
    )
    tests.add_argument("--tag", default=NEWEST, choices=list(TREES), help=f"the torch release (default {NEWEST})")
    tests.add_argument(
        "--selection",
        default="full",
        choices=sorted(SELECTIONS),
        help="full: what the series touches (78 files or -k subsets, hours on 2 cores); ci: the part nearest it",
    )
    tests.add_argument(
        "--file", action="append", metavar="PATH", help="a test file under test/ instead of a selection (repeatable)"
    )
    tests.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression for the --file entries")
    tests.add_argument("--jobs", type=positive(int), default=1, help="pytest processes at once (default %(default)s)")
    tests.add_argument(
        "--cache",
        metavar="DIR",
        help="the trees, venvs and runs (default $DFLASH_PYTORCH_TESTS or ~/.cache/dflash/pytorch-tests)",
    )
    tests.add_argument("--mirror", help="another mirror of the tag's archive (default: the archive trees.py names)")
    tests.add_argument(
        "--test-timeout",
        type=positive(float),
        default=600,
        help="seconds a test may take: a hang (default %(default)s)",
    )
    tests.add_argument(
        "--file-timeout", type=positive(float), default=7200, help="seconds a file's run may take (default %(default)s)"
    )
    tests.add_argument(
        "--out",
        metavar="DIR",
        help="reports and logs (default <cache>/<tag>/runs/<time>); an earlier run's folder is resumed: what "
        "finished there with the same tree, torch, series and arguments is reused, the rest runs",
    )
    tests.add_argument("--list", action="store_true", help="print the entries that would run, and stop")
    tests.set_defaults(func=_pytorch_tests)
