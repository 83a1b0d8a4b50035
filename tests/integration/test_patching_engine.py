"""The patch engine: hunk application, the series, the plan, and the import hook in fresh interpreters."""

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import unidiff

from dflash.patching import plan as plan_mod
from dflash.patching.hunks import PatchDoesNotFit, apply_hunks
from dflash.patching.records import all_records
from dflash.patching.series import (
    TEXT_FIELDS,
    SeriesError,
    concerns,
    diff_sha256,
    load_series,
    load_sources,
    parse_header,
    parse_patch,
    split_patch,
)
from dflash.patching.series_path import series_dir

SOURCE = "".join(f"line {i}\n" for i in range(1, 21))
DIFF = textwrap.dedent("""\
    --- a/torch/toy.py
    +++ b/torch/toy.py
    @@ -3,3 +3,3 @@
     line 3
    -line 4
    +LINE FOUR
     line 5
    @@ -15,3 +15,4 @@
     line 15
     line 16
    +inserted
     line 17
    """)


def _file(diff=DIFF):
    return unidiff.PatchSet(diff)[0]


def test_hunks_apply_exactly():
    out = apply_hunks(SOURCE, _file(), label="toy")
    assert "LINE FOUR\n" in out and "line 4\n" not in out
    assert out.index("line 16\ninserted\nline 17\n") > 0


def test_hunks_apply_at_an_offset_but_never_fuzzily():
    shifted = "new first line\n" * 5 + SOURCE
    assert apply_hunks(shifted, _file(), label="toy") == "new first line\n" * 5 + apply_hunks(
        SOURCE, _file(), label="toy"
    )
    changed_context = SOURCE.replace("line 16\n", "line sixteen\n")
    with pytest.raises(PatchDoesNotFit, match=r"toy: hunk .* does not match torch/toy.py .*line 16"):
        apply_hunks(changed_context, _file(), label="toy")


def test_header_parsing_and_errors():
    text = "Description: summary\n more\nPatch-Name: x\nTorch-Versions: >=2.5\nBase-Release: 2.13.0\n---\n" + DIFF
    patch = parse_patch("0009-x.patch", text)
    assert patch.name == "x" and patch.description == "summary\nmore" and str(patch.base_release) == "2.13.0"
    assert patch.modules == ("torch.toy",) and patch.diff_sha256 == diff_sha256(DIFF)
    variant = parse_patch("generated/0009-x/torch-2.5.patch", "Patch-Name: x\nTorch-Versions: >=2.5\n---\n" + DIFF)
    assert variant.diff_sha256 == patch.diff_sha256  # records name the diff, not the header
    with pytest.raises(SeriesError, match="no '---' line"):
        parse_patch("bad.patch", "Patch-Name: x\n" + DIFF.replace("---", "+++", 1))
    with pytest.raises(SeriesError, match="lacks the field 'Torch-Versions'"):
        parse_patch("bad.patch", "Patch-Name: x\n---\n" + DIFF)


def test_hunks_handle_crlf_files_and_show_mismatches_with_repr():
    crlf = SOURCE.replace("\n", "\r\n")
    assert apply_hunks(crlf, _file(), label="toy") == apply_hunks(SOURCE, _file(), label="toy").replace("\n", "\r\n")
    mixed = crlf.replace("line 4\r\n", "line 4\n")
    with pytest.raises(PatchDoesNotFit, match=re.escape("expected 'line 4\\r\\n', found 'line 4\\n'")):
        apply_hunks(mixed, _file(), label="toy")


def test_series_is_consistent():
    releases = [f"2.{minor}.0" for minor in range(5, 17)]
    for patch in load_sources():
        text_fields = [f for f in TEXT_FIELDS if f in parse_header(split_patch(patch.file_name, _read(patch))[0])]
        if "@" in patch.file_name:
            assert not text_fields, (patch.file_name, text_fields)  # one place per concern
        else:
            assert patch.header.get("Description") and patch.header.get("Bug") and patch.header.get("Origin")
    for name, variants in concerns().items():
        for patch in variants:
            assert patch.description, patch.file_name  # from the canonical file
            assert all(patch.torch_versions.contains(r) for r in patch.generated_on), patch.file_name
            assert all(_context_fits(h, last=h is f[-1]) for f in patch.files for h in f), patch.file_name
        for release in releases:
            claiming = [p.file_name for p in variants if p.torch_versions.contains(release)]
            assert len(claiming) <= 1, (name, release, claiming)
    assert len({p.file_name for p in load_series()}) == len(load_series())


def _read(patch):
    return (series_dir() / patch.file_name).read_text(encoding="utf-8")


def _context_fits(hunk, *, last: bool) -> bool:
    """Three lines of context on each side, fewer only where the file starts or, for its last hunk, ends."""
    lines = list(hunk)
    lead = next(i for i, line in enumerate(lines) if not line.is_context)
    trail = next(i for i, line in enumerate(reversed(lines)) if not line.is_context)
    short = hunk.source_length < 6
    return (lead >= 3 or hunk.source_start <= 3 or short) and (trail >= 3 or last or short)


def test_records_match_the_variants_that_claim_their_release():
    """A variant changed after the last verification of a release it claims, or a concern added
    since (the engine would refuse it there, and with it the whole series), needs a new record."""
    from packaging.version import Version

    stale = []
    for release, record in all_records().items():
        for name, variants in concerns().items():
            planned = plan_mod.choose_variant(name, variants, Version(release), True, record)
            if planned.state != plan_mod.PENDING:  # upstream or not applicable there
                continue
            patch = next(p for p in variants if p.file_name == planned.patch_file)
            if name not in record["patches"]:
                stale.append(f"{patch.file_name} is newer than the record of torch {release} ({record['date']})")
            elif record["patches"][name]["diff_sha256"] != patch.diff_sha256:
                stale.append(f"{patch.file_name} changed after the record of torch {release} ({record['date']})")
    assert not stale, "\n".join(stale) + "\nrerun `dflash patches verify --record` on those releases"


def _fake_torch(tmp_path: Path, version: str) -> Path:
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir(parents=True)
    (torch_dir / "version.py").write_text(f"__version__ = '{version}'\n")
    return torch_dir


def test_plan_states_for_each_kind_of_release(tmp_path):
    on_213 = plan_mod.make_plan(_fake_torch(tmp_path / "a", "2.13.0+cpu"), allow_unverified=True)
    assert on_213.outcomes["fx-tracing-flag-thread-local"].state == plan_mod.PENDING
    assert on_213.outcomes["fx-tracing-flag-legacy-attribute"].state == plan_mod.NOT_APPLICABLE
    on_215 = plan_mod.make_plan(_fake_torch(tmp_path / "b", "2.15.0"), allow_unverified=True)
    upstream = on_215.outcomes["fx-tracing-flag-thread-local"]
    assert upstream.state == plan_mod.UPSTREAM and "2.14.0" in upstream.reason


def test_only_a_record_naming_the_diff_verifies_a_variant():
    from packaging.version import Version

    name, variants = "config-process-defaults", concerns()["config-process-defaults"]
    release = Version("2.13.0")
    patch = next(p for p in variants if p.torch_versions.contains(release))
    record = {"date": "2026-12-01", "patches": {name: {"file": patch.file_name, "diff_sha256": patch.diff_sha256}}}
    assert plan_mod.choose_variant(name, variants, release, False, record).state == plan_mod.PENDING
    for other in (None, {"date": "2026-11-01", "patches": {name: {"file": "x", "diff_sha256": "0" * 64}}}):
        refused = plan_mod.choose_variant(name, variants, release, False, other)
        assert refused.state == plan_mod.FAILED and plan_mod.ALLOW_UNVERIFIED_ENV in refused.reason
        assert "not verified on torch 2.13.0" in refused.reason


def test_plan_is_all_or_none(tmp_path, monkeypatch):
    # A release where one concern has no variant: even with the opt-in nothing may be applied.
    import dflash.patching.series as series_mod

    real = series_mod.concerns()
    monkeypatch.setattr(series_mod, "concerns", lambda: {**real, "config-process-defaults": []})
    plan = plan_mod.make_plan(_fake_torch(tmp_path, "2.13.0"), allow_unverified=True)
    states = {o.state for o in plan.outcomes.values()}
    assert plan_mod.FAILED in states and plan_mod.PENDING not in states and plan.module_patches == {}
    refused = plan.outcomes["fx-tracing-flag-thread-local"]
    assert "all or none" in refused.reason and "config-process-defaults" in refused.reason


def test_plan_round_trips_through_json(tmp_path):
    plan = plan_mod.make_plan(_fake_torch(tmp_path, "2.13.0"), allow_unverified=True)
    plan.inputs = [["x", 1, 2]]
    again = plan_mod.Plan.from_json(plan.to_json())
    assert again.module_patches == plan.module_patches and again.inputs == plan.inputs
    assert {n: o.state for n, o in again.outcomes.items()} == {n: o.state for n, o in plan.outcomes.items()}


ALLOW = plan_mod.ALLOW_UNVERIFIED_ENV


def _python(code: str, *, env=None, flags=()):
    env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return proc


def test_installed_hook_patches_torch_in_a_fresh_interpreter():
    code = textwrap.dedent("""\
        import inspect, json, torch, torch.fx._symbolic_trace as st
        names = [c.__name__ for c in type(st).__mro__]
        print(json.dumps(["_FxTracingFlagModule" in names, "class _FxTracingFlagModule" in inspect.getsource(st)]))
        """)
    patched = _python(code)
    assert patched.returncode == 0, patched.stderr
    assert json.loads(patched.stdout.splitlines()[-1]) == [True, True]
    plain = _python(code, env={"DFLASH_PATCHES": "0"})
    assert json.loads(plain.stdout.splitlines()[-1]) == [False, False]


def test_an_unrecognised_dflash_patches_value_is_reported_and_leaves_the_patches_on():
    """Only 0/false/no/off turned the hook off; DFLASH_PATCHES=disable patched torch without a word."""
    code = "import torch.fx._symbolic_trace as st; print([c.__name__ for c in type(st).__mro__])"
    proc = _python(code, env={"DFLASH_PATCHES": "disable"})
    assert "_FxTracingFlagModule" in proc.stdout, proc.stderr  # patched, as unset
    warning = "DFLASH_PATCHES='disable' is not recognised: the thread-safety patches stay ON. Set DFLASH_PATCHES=0"
    assert proc.stderr.count(warning) == 1, proc.stderr
    for value in ("0", "off", "1", "Yes", ""):
        assert "not recognised" not in _python("pass", env={"DFLASH_PATCHES": value}).stderr
    status = subprocess.run(
        [sys.executable, "-m", "dflash", "patches", "status"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DFLASH_PATCHES": "maybe"},
    )
    assert "DFLASH_PATCHES='maybe' is not recognised" in status.stdout, status.stdout + status.stderr


def test_traceback_shows_patched_lines():
    code = textwrap.dedent("""\
        import traceback, torch.fx._symbolic_trace as st
        try:
            st._set_is_fx_tracing(None, None)
        except TypeError:
            pass
        import linecache
        print(linecache.getline(st.__file__, st._get_is_fx_tracing.__code__.co_firstlineno))
        """)
    proc = _python(code)
    assert "def _get_is_fx_tracing" in proc.stdout, proc.stderr


@pytest.mark.parametrize("in_thread", [False, True])
def test_uncaught_traceback_shows_patched_lines(in_thread):
    # The getter of the patched module's _is_fx_tracing_flag view calls _get_is_fx_tracing();
    # on disk that line number holds something else.
    read = "threading.Thread(target=lambda: st._is_fx_tracing_flag).start()" if in_thread else "st._is_fx_tracing_flag"
    code = f"import threading, torch.fx._symbolic_trace as st\nst._get_is_fx_tracing = None\n{read}\n"
    proc = _python(code)
    assert "TypeError: 'NoneType' object is not callable" in proc.stderr, proc.stderr
    assert "return _get_is_fx_tracing()" in proc.stderr, proc.stderr
    assert ("Exception in thread" in proc.stderr) is in_thread


def test_torch_imported_before_the_hook_is_reported():
    # -S skips site-packages' .pth files; put site-packages back by hand, import torch, then the hook.
    site = sysconfig.get_paths()["purelib"]
    code = f"import sys; sys.path.append({site!r}); import torch; import dflash.patching.startup as s; s.install()"
    proc = _python(code, flags=("-S",), env={"PYTHONPATH": str(Path(__file__).parents[2])})
    assert "torch was imported before the dflash thread-safety patch hook ran" in proc.stderr
    assert "Fix:" in proc.stderr


def test_status_json_shape():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash", "patches", "status", "--json"], capture_output=True, text=True, timeout=300
    )
    report = json.loads(proc.stdout)
    assert set(report) == {"torch_version", "hook_active", "patches", "cache"} and report["hook_active"] is True
    states = {p["name"]: p["state"] for p in report["patches"]}
    assert states and all(s in ("applied", "upstream", "not-applicable") for s in states.values()), states
    assert proc.returncode == 0


def test_thread_safety_gap_is_none_only_with_every_concern_covered():
    """What a threaded compiled run asks before its drafter threads compile (the trainer warns on a gap)."""
    code = "from dflash.patching.status import thread_safety_gap; print(repr(thread_safety_gap()))"
    assert _python(code).stdout.splitlines()[-1] == "None"
    assert "disabled: DFLASH_PATCHES=0 is set" in _python(code, env={"DFLASH_PATCHES": "0"}).stdout
    site = sysconfig.get_paths()["purelib"]
    first = f"import sys; sys.path.append({site!r}); import torch; " + code
    late = _python(first, flags=("-S",), env={"PYTHONPATH": str(Path(__file__).parents[2])}).stdout
    assert " failed: the startup hook is not active" in late, late


def _symlinked_torch(tmp_path: Path) -> Path:
    import torch

    real = Path(torch.__file__).parent
    subprocess.run(["cp", "-rs", str(real), str(tmp_path / "torch")], check=True)
    return real


def _replace(path: Path, text: str) -> None:
    path.unlink()
    path.write_text(text)


def test_mismatching_module_refuses_the_whole_series_and_says_why(tmp_path):
    # A torch tree whose torch/compiler/__init__.py differs from what the series expects: all or
    # none, so every module loads as it is on disk, and both the warning and `status` name the hunk.
    real = _symlinked_torch(tmp_path)
    compiler = tmp_path / "torch" / "compiler" / "__init__.py"
    text = (real / "compiler" / "__init__.py").read_text()
    _replace(compiler, text.replace("    return _is_exporting_flag\n", "    return bool(_is_exporting_flag)\n"))
    code = textwrap.dedent("""\
        import json, torch, torch.compiler, torch.fx._symbolic_trace as st
        from dflash.patching.status import collect
        states = {p["name"]: p for p in collect()["patches"]}
        print(json.dumps([torch.__file__, type(torch.compiler).__name__, type(st).__name__,
                          states["compile-session-flags-thread-local"], states["fx-tracing-flag-thread-local"]]))
        """)
    env = {"PYTHONPATH": str(tmp_path), "DFLASH_PATCH_CACHE": str(tmp_path / "cache"), ALLOW: "1"}
    proc = _python(code, env=env)
    assert proc.returncode == 0, proc.stderr
    torch_file, compiler_type, st_type, mismatch, other = json.loads(proc.stdout.splitlines()[-1])
    assert torch_file.startswith(str(tmp_path))
    assert (compiler_type, st_type) == ("module", "module")
    assert mismatch["state"] == "failed" and "does not match torch/compiler/__init__.py" in mismatch["reason"]
    assert other["state"] == "failed" and "all or none" in other["reason"]
    assert proc.stderr.count("NOT applied to torch") == 1 and "DFLASH_PATCHES=0" in proc.stderr


def test_uncovered_release_runs_plain_torch_and_warns_once(tmp_path):
    real = _symlinked_torch(tmp_path)
    version = (real / "version.py").read_text()
    _replace(tmp_path / "torch" / "version.py", re.sub(r"__version__ = '[^']*'", "__version__ = '2.4.1'", version))
    code = "import torch, torch._dynamo, torch.fx._symbolic_trace as st; print(type(st).__name__)"
    env = {"PYTHONPATH": str(tmp_path), "DFLASH_PATCH_CACHE": str(tmp_path / "cache")}
    for extra in ({}, {ALLOW: "1"}):
        proc = _python(code, env={**env, **extra})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["module"]
        assert proc.stderr.count("NOT applied to torch 2.4.1") == 1, proc.stderr
        assert "DFLASH_PATCHES=0" in proc.stderr
    silenced = _python(code, env={**env, "DFLASH_PATCHES": "0"})
    assert "NOT applied" not in silenced.stderr


def test_verify_rejects_unknown_classes_and_non_positive_budgets(capsys):
    from dflash.cli import main

    assert main(["patches", "verify", "Z"]) == 2
    assert "unknown bug class Z; choose from A B C D E F G H" in capsys.readouterr().err
    for bad in (["--seconds", "0"], ["--seconds", "nan"], ["--jobs", "0"], ["--jobs", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["patches", "verify", *bad, "A"])
        assert exit_info.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_status_prints_a_long_reason_shared_by_several_patches_once():
    # -S: no startup hook, so torch loads unpatched and every applicable patch gets the same long reason.
    site = sysconfig.get_paths()["purelib"]
    code = (
        f"import sys; sys.path.append({site!r}); import torch; from dflash.cli import main; main(['patches', 'status'])"
    )
    proc = _python(code, flags=("-S",), env={"PYTHONPATH": str(Path(__file__).parents[2]), "DFLASH_PATCHES": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("see [1] below" in line for line in lines) >= 2, proc.stdout
    footnotes = [line for line in lines if line.startswith("[1] ")]
    assert len(footnotes) == 1 and "torch was imported before" in footnotes[0]
