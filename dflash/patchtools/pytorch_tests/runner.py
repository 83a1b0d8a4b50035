"""Run a selection of PyTorch's tests plain and patched, compare them outcome by outcome, rerun each
difference alone both ways, and tabulate.

Every entry (a file, or a ``-k`` subset of one) runs in a fresh pytest process from the tree's
``test/`` (``PYTHONPATH=.``), once with ``DFLASH_PATCHES=0`` (plain torch) and once with the series.
A test whose outcome differs is run again alone, plain and patched, each in its own process: a
difference that holds alone is the series' (``changes outcome``); one that disappears alone
depended on what ran before it or on load, and is listed but not counted. A test that timed out in
the full run is a hang and counts whatever it does alone.

A run in the folder of an earlier one reuses each process that finished there with the same key and
runs the rest (:mod:`~dflash.patchtools.pytorch_tests.resume`); the first SIGINT or SIGTERM ends the
processes in flight, which a later run then runs again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from xml.etree import ElementTree

from dflash.patchtools.pytorch_tests.outcomes import ERROR, FAILED, PASSED, SKIPPED, TIMEOUT, read_outcomes
from dflash.patchtools.pytorch_tests.resume import NOT_RUN, Setup, Side, outcome_environment
from dflash.patchtools.pytorch_tests.selections import Entry
from dflash.signals import Stopped, StopRequest

ABSENT = "absent"  # not reported on this side
HUNG = "hung (killed at the file time limit)"
RAN = "ran"  # a file run that ended as pytest ends
ORDER_OR_LOAD = "same outcome alone (depends on order or load)"
PYTEST_NORMAL_EXITS = (0, 1, 5)  # all passed, some failed, none collected


@dataclasses.dataclass
class FileRun:
    """One pytest process: its exit, duration and every test's outcome (empty when it left no report)."""

    returncode: int | None  # None: killed at the file time limit
    seconds: float
    outcomes: dict[str, str]
    log: str
    reused_from: str | None = None  # the commit of the earlier run that left it; None: run now

    @property
    def problem(self) -> str | None:
        """Why the process did not end as pytest ends, or None."""
        if self.returncode is None:
            return HUNG
        if self.returncode not in PYTEST_NORMAL_EXITS and not self.outcomes:
            return f"no report (exit {self.returncode})"
        return None


@dataclasses.dataclass
class Difference:
    """A test (or a whole file run) whose outcome differs plain vs patched."""

    node: str
    plain: str
    patched: str
    plain_alone: str = ""
    patched_alone: str = ""

    @property
    def verdict(self) -> str:
        if {TIMEOUT, HUNG} & {self.plain, self.patched}:
            return "hang in the full run"
        if (self.plain_alone, self.patched_alone) == (self.plain, self.patched):
            return "changes outcome"
        if self.plain_alone == self.patched_alone:
            return ORDER_OR_LOAD
        return "differs alone too"

    @property
    def counts(self) -> bool:
        """A difference of the series, not of the order the tests ran in."""
        return self.verdict != ORDER_OR_LOAD


def child_environment() -> dict[str, str]:
    """This process's environment as every pytest process gets it, with one OpenMP thread unless set."""
    return {"OMP_NUM_THREADS": "1", **os.environ}


@dataclasses.dataclass
class Runner:
    """How each pytest process is started: the venv's python, the tree's ``test/``, where reports go,
    what their records are keyed by; and the processes in flight, which :meth:`stop` ends."""

    python: Path
    test_dir: Path
    out: Path
    test_timeout_s: float
    file_timeout_s: float
    setup: Setup
    _running: set = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _stopped: threading.Event = dataclasses.field(
        default_factory=threading.Event, init=False, repr=False, compare=False
    )

    def side(self, args: list[str], name: str, *, patched: bool) -> Side:
        """The files of the process running ``args`` (paths under ``test/``, ``-k``) on one side."""
        folder = self.out / ("patched" if patched else "plain")
        pytest_args = [
            *args,
            "-p",
            "no:cacheprovider",
            "-q",
            "--rootdir",
            ".",
            "-o",
            "junit_family=xunit1",
            f"--timeout={self.test_timeout_s:g}",
        ]
        key = self.setup.key(pytest_args, self.file_timeout_s, patched=patched)
        return Side(folder / f"{name}.xml", folder / f"{name}.log", key, patched)

    def previous(self, side: Side) -> FileRun | str:
        """The run ``side`` finished earlier in this folder with the same key, or why it runs now."""
        record = side.finished()
        if isinstance(record, str):
            return record
        return FileRun(record["returncode"], record["seconds"], _outcomes(side.xml), str(side.log), record["commit"])

    def run(self, side: Side) -> FileRun:
        """Run ``side``'s process (after removing its earlier record and report) and read its report."""
        side.xml.parent.mkdir(parents=True, exist_ok=True)
        side.forget()
        command = [str(self.python), "-m", "pytest", *side.key["args"], f"--junitxml={side.xml}"]
        env = dict(child_environment(), DFLASH_PATCHES="1" if side.patched else "0", PYTHONPATH=str(self.test_dir))
        started = time.monotonic()
        with side.log.open("w") as out:
            with self._lock:
                if self._stopped.is_set():
                    raise KeyboardInterrupt("the run is stopping")
                process = subprocess.Popen(command, cwd=self.test_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
                self._running.add(process)
            try:
                returncode = process.wait(timeout=self.file_timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                if process.returncode is None:  # at the file time limit, or the run is stopping
                    process.kill()
                    process.wait()
                with self._lock:
                    self._running.discard(process)
        return FileRun(returncode, time.monotonic() - started, _outcomes(side.xml), str(side.log))

    def keep(self, side: Side, run: FileRun) -> None:
        """Record that ``side`` ended on its own (only the main thread calls it: after a first SIGINT or
        SIGTERM, :class:`~dflash.signals.Stopped` is raised there before any process cut off by it is kept)."""
        side.keep(run.returncode, run.seconds, self.setup.commit)

    #: Seconds a pytest process has to end after SIGTERM before it is killed (one that ignores the
    #: signal, or hangs in its handler, would otherwise hold the run until the file time limit).
    stop_grace_s: float = 10.0

    def stop(self) -> None:
        """End the processes in flight (SIGTERM, then SIGKILL after :attr:`stop_grace_s`) and start no more."""
        with self._lock:
            self._stopped.set()
            for process in self._running:
                process.terminate()
        killer = threading.Timer(self.stop_grace_s, self._kill_running)
        killer.daemon = True
        killer.start()

    def _kill_running(self) -> None:
        with self._lock:
            for process in self._running:
                process.kill()


def _outcomes(xml: Path) -> dict[str, str]:
    try:
        return read_outcomes(xml)
    except (FileNotFoundError, ElementTree.ParseError):
        return {}


def run_selection(runner: Runner, entries: tuple[Entry, ...], jobs: int) -> dict[tuple[Entry, bool], FileRun]:
    """Every entry plain and patched, ``jobs`` processes at a time, reusing those that finished earlier in
    the runner's folder; a line on stderr as each ends (or is reused), and why each that had run before
    runs again."""
    tasks = [(entry, patched) for entry in entries for patched in (False, True)]
    sides = {task: runner.side(task[0].pytest_args(), task[0].slug, patched=task[1]) for task in tasks}
    done: dict[tuple[Entry, bool], FileRun] = {}
    todo = []
    for task in tasks:
        found = runner.previous(sides[task])
        if isinstance(found, FileRun):
            done[task] = found
            _progress(len(done), len(tasks), task, found)
        else:
            todo.append(task)
            if found != NOT_RUN:
                print(f"running again, {_side(task[1]).strip()} {task[0].label}: {found}", file=sys.stderr)
    if done:
        print(f"reused {len(done)} of {len(tasks)} file runs finished earlier in {runner.out}", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(runner.run, sides[task]): task for task in todo}
        try:
            for future in as_completed(futures):
                task = futures[future]
                run = future.result()
                runner.keep(sides[task], run)
                done[task] = run
                _progress(len(done), len(tasks), task, run)
        except BaseException:
            runner.stop()
            pool.shutdown(cancel_futures=True)
            raise
    return done


def _progress(number: int, total: int, task: tuple[Entry, bool], run: FileRun) -> None:
    counts = Counter(run.outcomes.values())
    summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or run.problem or "no tests"
    reused = f", reused from commit {run.reused_from}" if run.reused_from else ""
    print(
        f"[{number}/{total}] {_side(task[1])} {task[0].label}: {summary} ({run.seconds:.0f} s{reused})", file=sys.stderr
    )


def _side(patched: bool) -> str:
    return "patched" if patched else "plain  "


def differences(plain: FileRun, patched: FileRun, entry: Entry) -> list[Difference]:
    """Outcome by outcome; a file run that left no report (or hung) on either side is one difference."""
    if plain.problem or patched.problem:
        if plain.problem == patched.problem:
            return []
        return [Difference(entry.label, plain.problem or RAN, patched.problem or RAN)]
    nodes = dict.fromkeys([*plain.outcomes, *patched.outcomes])
    return [
        Difference(node, plain.outcomes.get(node, ABSENT), patched.outcomes.get(node, ABSENT))
        for node in nodes
        if plain.outcomes.get(node, ABSENT) != patched.outcomes.get(node, ABSENT)
    ]


def rerun_alone(runner: Runner, difference: Difference, entry: Entry) -> list[FileRun]:
    """Fill in the outcomes of ``difference`` run alone, plain and patched (a whole entry for a file-level
    one), reusing such runs that finished earlier in the runner's folder; the two runs."""
    file_level = difference.node == entry.label
    args = entry.pytest_args() if file_level else [difference.node]
    name = f"alone__{entry.slug}__{hashlib.sha256(difference.node.encode()).hexdigest()[:8]}"
    runs = []
    for patched in (False, True):
        side = runner.side(args, name, patched=patched)
        run = runner.previous(side)
        if isinstance(run, FileRun):
            print(f"  {_side(patched).strip()}: reused its run alone from commit {run.reused_from}", file=sys.stderr)
        else:
            run = runner.run(side)
            runner.keep(side, run)
        runs.append(run)
        if file_level:
            outcome = run.problem or RAN
        else:
            outcome = run.outcomes.get(difference.node, run.problem or ABSENT)
        if patched:
            difference.patched_alone = outcome
        else:
            difference.plain_alone = outcome
    return runs


def entry_table(entries: tuple[Entry, ...], runs: dict[tuple[Entry, bool], FileRun], found: dict) -> str:
    """Markdown: per entry, passed / failed (with errors) / skipped plain and patched, and its differences."""
    lines = [
        "| test file | plain: passed / failed / skipped | patched: passed / failed / skipped | outcome differences |",
        "|---|---|---|---|",
    ]
    for entry in entries:
        cells = [_counts(runs[(entry, patched)]) for patched in (False, True)]
        counted = [d for d in found[entry] if d.counts]
        lines.append(f"| `{entry.label}` | {cells[0]} | {cells[1]} | {len(counted) or 'none'} |")
    return "\n".join(lines)


def _counts(run: FileRun) -> str:
    if run.problem:
        return run.problem
    counts = Counter(run.outcomes.values())
    failed = counts[FAILED] + counts[ERROR] + counts[TIMEOUT]
    return f"{counts[PASSED]} / {failed} / {counts[SKIPPED]}"


def difference_table(found: dict) -> str:
    """Markdown: every difference, its outcomes in the full runs and alone, and the verdict."""
    rows = [d for diffs in found.values() for d in diffs]
    if not rows:
        return "No test changes outcome."
    lines = ["| test | plain | patched | plain alone | patched alone | verdict |", "|---|---|---|---|---|---|"]
    lines += [
        f"| `{d.node}` | {d.plain} | {d.patched} | {d.plain_alone} | {d.patched_alone} | {d.verdict} |" for d in rows
    ]
    return "\n".join(lines)


def write_json(path: Path, entries: tuple[Entry, ...], runs: dict, found: dict, header: dict) -> None:
    """Every run's outcomes and every difference, for later comparison."""
    record = {
        **header,
        "entries": [
            {
                "entry": entry.label,
                **{
                    side: {
                        "returncode": runs[(entry, patched)].returncode,
                        "seconds": round(runs[(entry, patched)].seconds, 1),
                        "outcomes": runs[(entry, patched)].outcomes,
                        "log": runs[(entry, patched)].log,
                    }
                    for side, patched in (("plain", False), ("patched", True))
                },
                "differences": [{**dataclasses.asdict(d), "verdict": d.verdict} for d in found[entry]],
            }
            for entry in entries
        ],
    }
    path.write_text(json.dumps(record, indent=1))


def run_tests(
    tag: str,
    entries: tuple[Entry, ...],
    *,
    cache: Path,
    mirror: str | None,
    jobs: int,
    test_timeout_s: float,
    file_timeout_s: float,
    out: Path | None,
) -> int:
    """Fetch the tag's tree, prepare its venv, run ``entries`` plain and patched, rerun each difference
    alone, print the tables (stdout; progress on stderr). Exit code 1 when a test changes outcome or a file
    could be compared on neither side (it left no report); 128 + the signal after a SIGINT or SIGTERM,
    with what the same ``out`` resumes. An ``out`` of an earlier run is resumed: the processes that
    finished there with the same tree, torch, series and arguments are reused (:mod:`.resume`).

    Raises:
        ValueError: an unknown tag, or a tree that is not the pinned one.
        OSError: the tree could not be downloaded.
        VenvError: the venv could not be made, or the series would not apply there.
    """
    from datetime import datetime, timezone

    from dflash.patchtools.pytorch_tests import environment, trees
    from dflash.patchtools.pytorch_tests.resume import series_digest

    tree = trees.tag_tree(tag)
    project = Path(__file__).resolve().parents[3]
    if not (project / "pyproject.toml").exists():
        raise environment.VenvError(f"{project} is not a dflash source checkout (no pyproject.toml)")
    started = datetime.now(timezone.utc)
    print(f"torch {tag}: the test tree of {tree.package}", file=sys.stderr)
    src = trees.fetch(tree, cache, mirror)
    print(f"preparing {cache / tag / 'venv'} (the first time: torch {tag} and the test packages)", file=sys.stderr)
    python = environment.prepare(tree, src, cache, project)
    out = out or cache / tag / "runs" / started.strftime("%Y%m%d-%H%M%S")
    setup = Setup(
        tree.sha256,
        environment.torch_version(python),
        series_digest(tag),
        _commit(project),
        outcome_environment(child_environment()),
    )
    runner = Runner(python, src / "test", out, test_timeout_s, file_timeout_s, setup)
    stopping = f"ending the pytest processes in flight (--out {out} resumes the run)"
    try:
        with StopRequest(stopping, interrupting="PyTorch's tests").installed():
            try:
                runs = run_selection(runner, entries, jobs)
                found = {entry: differences(runs[(entry, False)], runs[(entry, True)], entry) for entry in entries}
                alone = []
                for entry, diffs in found.items():
                    for difference in diffs:
                        print(f"rerunning alone, plain and patched: {difference.node}", file=sys.stderr)
                        alone += rerun_alone(runner, difference, entry)
            except BaseException:
                runner.stop()
                raise
    except Stopped as stopped:
        print(f"{stopped}; what finished is kept in {out}: the same command with --out {out} resumes", file=sys.stderr)
        return 128 + stopped.signum
    minutes = (datetime.now(timezone.utc) - started).total_seconds() / 60
    reused = [run.reused_from for run in [*runs.values(), *alone] if run.reused_from]
    header = {
        "date": started.isoformat(timespec="seconds"),
        "tag": tag,
        "tree": f"{tree.tarball} (sha256 {tree.sha256[:12]}...)",
        "torch": setup.torch,
        "commit": setup.commit,
        "minutes": round(minutes, 1),
        "reused_file_runs": len(reused),
        "reused_from_commits": sorted(set(reused)),
    }
    write_json(out / "results.json", entries, runs, found, header)
    counted = [d for diffs in found.values() for d in diffs if d.counts]
    # A file that left no report on either side was not compared at all: the check did not run.
    uncompared = [e.label for e in entries if runs[(e, False)].problem and runs[(e, True)].problem]
    resumed = (
        f" (resumed: {len(reused)} of {len(runs) + len(alone)} file runs are an earlier run's in this folder, "
        f"commit {', '.join(header['reused_from_commits'])})"
        if reused
        else ""
    )
    print(
        f"{header['date'][:10]}, commit {header['commit']}, torch {header['torch']}, PyTorch's v{tag} tests "
        f"({tree.tarball} of {tree.package}), {len(entries)} test files or -k subsets, "
        f"each in its own process plain (DFLASH_PATCHES=0) and patched, {jobs} at a time, {minutes:.0f} min"
        f"{resumed}:\n"
    )
    print(entry_table(entries, runs, found) + "\n")
    print(difference_table(found) + "\n")
    tests = len({node for run in runs.values() for node in run.outcomes})
    print(f"{len(counted)} outcome differences in {tests} tests; outcomes of every test: {out / 'results.json'}")
    if uncompared:
        print(f"not compared (no report plain or patched; see the logs): {', '.join(uncompared)}")
    return 1 if counted or uncompared else 0


def _commit(project: Path) -> str:
    """The checkout's commit, marked when tracked files differ from it (the results are then not its)."""
    head = subprocess.run(["git", "-C", str(project), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        ["git", "-C", str(project), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    commit = head.stdout.strip() or "unknown"
    return f"{commit} with uncommitted changes" if changed.stdout.strip() else commit
