"""The patch engine: hunk application, the series, the plan, and the import hook in fresh interpreters."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import unidiff

from dflash.patching import plan as plan_mod
from dflash.patching.hunks import PatchDoesNotFit, apply_hunks
from dflash.patching.series import SeriesError, concerns, load_series, parse_patch

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
    text = (
        "Description: summary\n more\nPatch-Name: x\nTorch-Versions: >=2.5\nVerified-On: 2.11.0, 2.13.0\n---\n" + DIFF
    )
    patch = parse_patch("0009-x.patch", text)
    assert patch.name == "x" and patch.description == "summary\nmore"
    assert [str(v) for v in patch.verified_on] == ["2.11.0", "2.13.0"] and patch.modules == ("torch.toy",)
    with pytest.raises(SeriesError, match="no '---' line"):
        parse_patch("bad.patch", "Patch-Name: x\n" + DIFF.replace("---", "+++", 1))
    with pytest.raises(SeriesError, match="lacks the field 'Torch-Versions'"):
        parse_patch("bad.patch", "Patch-Name: x\n---\n" + DIFF)


def test_series_is_consistent():
    releases = [f"2.{minor}.0" for minor in range(5, 16)]
    for name, variants in concerns().items():
        for patch in variants:
            assert patch.header.get("Description") and patch.header.get("Bug") and patch.header.get("Origin")
            for verified in patch.verified_on:
                assert patch.torch_versions.contains(verified), (patch.file_name, verified)
        for release in releases:
            claiming = [p.file_name for p in variants if p.torch_versions.contains(release)]
            assert len(claiming) <= 1, (name, release, claiming)
    assert len({p.file_name for p in load_series()}) == len(load_series())


def _fake_torch(tmp_path: Path, version: str) -> Path:
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir(parents=True)
    (torch_dir / "version.py").write_text(f"__version__ = '{version}'\n")
    return torch_dir


def test_plan_states_for_each_kind_of_release(tmp_path):
    on_213 = plan_mod.make_plan(_fake_torch(tmp_path / "a", "2.13.0+cpu"), allow_unverified=False)
    assert on_213.outcomes["fx-tracing-flag-thread-local"].state == plan_mod.PENDING
    assert on_213.outcomes["fx-tracing-flag-legacy-attribute"].state == plan_mod.NOT_APPLICABLE
    on_215 = plan_mod.make_plan(_fake_torch(tmp_path / "b", "2.15.0"), allow_unverified=False)
    upstream = on_215.outcomes["fx-tracing-flag-thread-local"]
    assert upstream.state == plan_mod.UPSTREAM and "2.14.0" in upstream.reason


def test_plan_refuses_unverified_release_with_the_fix(tmp_path):
    plan = plan_mod.make_plan(_fake_torch(tmp_path, "2.12.1"), allow_unverified=False)
    refused = plan.outcomes["compile-wrapper-guard"]
    assert refused.state == plan_mod.FAILED
    assert "not a release" in refused.reason and plan_mod.ALLOW_UNVERIFIED_ENV in refused.reason
    allowed = plan_mod.make_plan(_fake_torch(tmp_path / "c", "2.12.1"), allow_unverified=True)
    assert allowed.outcomes["compile-wrapper-guard"].state == plan_mod.PENDING


def test_plan_round_trips_through_json(tmp_path):
    plan = plan_mod.make_plan(_fake_torch(tmp_path, "2.13.0"), allow_unverified=False)
    again = plan_mod.Plan.from_json(plan.to_json())
    assert again.module_patches == plan.module_patches
    assert {n: o.state for n, o in again.outcomes.items()} == {n: o.state for n, o in plan.outcomes.items()}


def _python(code: str, *, env=None, flags=()):
    env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return proc


def test_installed_hook_patches_torch_in_a_fresh_interpreter():
    code = textwrap.dedent("""\
        import inspect, json, torch, torch.fx._symbolic_trace as st
        print(json.dumps([type(st).__name__, "class _FxTracingFlagModule" in inspect.getsource(st)]))
        """)
    patched = _python(code)
    assert patched.returncode == 0, patched.stderr
    assert json.loads(patched.stdout.splitlines()[-1]) == ["_FxTracingFlagModule", True]
    plain = _python(code, env={"DFLASH_PATCHES": "0"})
    assert json.loads(plain.stdout.splitlines()[-1]) == ["module", False]


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


def test_mismatching_module_loads_unpatched_and_says_why(tmp_path):
    # A torch tree whose torch/compiler/__init__.py differs from what the series expects: that
    # module must load as it is on disk (none of its hunks), the other modules stay patched, and
    # both the warning and `status` name the hunk.
    import torch

    real = Path(torch.__file__).parent
    subprocess.run(["cp", "-rs", str(real), str(tmp_path / "torch")], check=True)
    compiler = tmp_path / "torch" / "compiler" / "__init__.py"
    text = (real / "compiler" / "__init__.py").read_text()
    compiler.unlink()
    compiler.write_text(text.replace("_is_exporting_flag: bool = False", "_is_exporting_flag: bool = bool(0)"))
    code = textwrap.dedent("""\
        import json, torch, torch.compiler, torch.fx._symbolic_trace as st
        from dflash.patching.status import collect
        states = {p["name"]: p for p in collect()["patches"]}
        print(json.dumps([torch.__file__, type(torch.compiler).__name__, type(st).__name__,
                          states["compile-session-flags-thread-local"]]))
        """)
    proc = _python(code, env={"PYTHONPATH": str(tmp_path), "DFLASH_PATCH_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    torch_file, compiler_type, st_type, outcome = json.loads(proc.stdout.splitlines()[-1])
    assert torch_file.startswith(str(tmp_path))
    assert (compiler_type, st_type) == ("module", "_FxTracingFlagModule")
    assert outcome["state"] == "failed" and "does not match torch/compiler/__init__.py" in outcome["reason"]
    assert "PatchWarning" in proc.stderr and "Nothing was applied to torch.compiler" in proc.stderr


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
