"""``dflash patches upstream``: the PyTorch stack made from the patch series, for a main checkout.

The trees are laid out like a PyTorch checkout (``torch/...``, ``test/...``, ``version.txt``) and
committed in a temporary git repository. Their ``test/`` files are small stand-ins with the shapes of
PyTorch's (``from fx.test_* import`` lines in ``test/test_fx.py``, a ``TestConfigModule.tearDown``
and ``test_get_hash_per_thread_isolation`` in ``test/test_utils_config_module.py``). Two stand-ins
for PyTorch main:

- ``main_tree``: the 2.15.0 sources (``DFLASH_TORCH_SOURCES``, ``scripts/fetch_torch_sources.py
  --series``) labelled ``2.16.0a0``: main as it is now. Its tests only make the kit (no runs unless
  the installed torch is a 2.15 build, whose compiled parts the runs borrow);
- ``installed_main_tree``: the installed torch's files labelled as the development version of its
  release (``2.13.0a0`` on CI's 2.13.0): main as it was before that release, whose runs borrow the
  installed torch's compiled parts, so every commit's tests run without and with it, and the stack
  check runs on it.

Release trees (``2.13.0``, ``2.15.0``) are refused.

Integration tier: every test runs git in subprocesses (about 20 s together on 2 cores), and
``test_each_commit_passes_its_tests_alone_and_fails_without_its_fix`` runs every commit's tests
without it and the tests of commits 1..k with commits 1..k only, in fresh processes (3-10 minutes
on 2 cores, depending on load; needs ``expecttest``, PyTorch's test dependency).
"""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from dflash.cli import main
from dflash.patching.series import load_series
from dflash.patchtools.upstream import (
    KEPT_OUT,
    PASSES_WITHOUT,
    PRESENT,
    PROPOSED,
    REBASED,
    SHOWN,
    STACK_FAILS,
    STACK_PASSES,
    UpstreamKitError,
    lint,
    make_kit,
    runs,
    tree_release,
)
from dflash.patchtools.upstream import concerns as concerns_module
from dflash.patchtools.upstream import (
    kit as kit_module,
)
from dflash.patchtools.upstream.kit import verdict
from dflash.patchtools.upstream.placement import merge_tests
from dflash.patchtools.upstream.text import internal_references, patch_text_to_check

TORCH_DIR = Path(torch.__file__).parent

TEST_AUTOGRAD = """\
# Owner(s): ["module: autograd"]
import torch

from autograd.test_complex import TestAutogradComplex  # noqa: F401
from autograd.test_functional import TestAutogradFunctional  # noqa: F401
from autograd.test_logging import TestAutogradLogging  # noqa: F401
from torch.testing._internal.common_utils import run_tests


if __name__ == "__main__":
    run_tests()
"""
TEST_FX = """\
# Owner(s): ["module: fx"]
import torch

from fx.test_cse_pass import TestCSEPass  # noqa: F401
from fx.test_fx_param_shape_control_flow import (  # noqa: F401
    TestConstParamShapeInControlFlow,
)
from fx.test_matcher_utils import TestMatcher  # noqa: F401
from torch.testing._internal.common_utils import run_tests


if __name__ == "__main__":
    run_tests()
"""
TEST_DYNAMO = """\
# Owner(s): ["module: dynamo"]

import torch
import torch._dynamo.test_case


class {cls}(torch._dynamo.test_case.TestCase):
    def test_nothing(self):
        self.assertTrue(torch.ones(1).item())


if __name__ == "__main__":
    from torch._dynamo.test_case import run_tests

    run_tests()
"""
TEST_CONFIG_MODULE = """\
# Owner(s): ["module: unknown"]
import threading

from torch.testing._internal import fake_config_module as config
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.utils._config_module import _UNSET_SENTINEL


class TestConfigModule(TestCase):
    def tearDown(self):
        # Config changes get persisted between test cases
        for k in config._config:
            config._config[k].user_override.set(_UNSET_SENTINEL)
            config._config[k].hide = False
        config._hash_cache_var.set(None)

    def test_overrides(self):
        config.e_int = 2
        self.assertEqual(config.e_int, 2)

    def test_get_hash_per_thread_isolation(self):
        base_hash = config.get_hash()
        thread_hash = [None]

        def thread_fn():
            config.e_int = 999
            thread_hash[0] = config.get_hash()

        t = threading.Thread(target=thread_fn)
        t.start()
        t.join()
        self.assertEqual(config.get_hash(), base_hash)
        self.assertNotEqual(thread_hash[0], base_hash)


if __name__ == "__main__":
    run_tests()
"""


def _git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def _make_tree(root: Path, version: str, *, crlf: str | None = None, torch_dir: Path = TORCH_DIR) -> Path:
    """A git tree labelled ``version`` holding the files of ``torch_dir`` the series touches."""
    for path in {f.path for patch in load_series() for f in patch.files}:
        if (torch_dir / path.removeprefix("torch/")).exists():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(torch_dir / path.removeprefix("torch/"), root / path)
    (root / "test" / "dynamo").mkdir(parents=True)
    (root / "test" / "test_fx.py").write_text(TEST_FX)
    (root / "test" / "test_autograd.py").write_text(TEST_AUTOGRAD)
    (root / "test" / "dynamo" / "test_config.py").write_text(TEST_DYNAMO.format(cls="ConfigTests"))
    (root / "test" / "dynamo" / "test_compile.py").write_text(TEST_DYNAMO.format(cls="InPlaceCompilationTests"))
    (root / "test" / "test_utils_config_module.py").write_text(TEST_CONFIG_MODULE)
    (root / "version.txt").write_text(version + "\n")
    if crlf:
        (root / crlf).write_bytes((root / crlf).read_bytes().replace(b"\n", b"\r\n"))
    _git(root, "init", "-q")
    _git(root, "config", "user.name", "Kit Tester")
    _git(root, "config", "user.email", "kit@example.com")
    _git(root, "config", "core.autocrlf", "false")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    return root


INSTALLED_RELEASE = torch.__version__.split("+")[0]
SOURCES = Path(os.environ.get("DFLASH_TORCH_SOURCES", "/nonexistent"))


@pytest.fixture
def installed_main_tree(tmp_path) -> Path:
    """Main before the installed torch's release: its files, labelled ``<release>a0``."""
    return _make_tree(tmp_path / "pytorch", f"{INSTALLED_RELEASE}a0")


@pytest.fixture
def main_tree(tmp_path) -> Path:
    """Main now: the 2.15.0 sources labelled 2.16.0a0."""
    if not (SOURCES / "2.15.0" / "torch").is_dir():
        pytest.skip("needs the 2.15.0 sources in DFLASH_TORCH_SOURCES (scripts/fetch_torch_sources.py --series)")
    return _make_tree(tmp_path / "pytorch", "2.16.0a0", torch_dir=SOURCES / "2.15.0" / "torch")


def _clone(tree: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(tree), str(dest)], check=True)
    _git(dest, "config", "user.name", "Kit Tester")
    _git(dest, "config", "user.email", "kit@example.com")
    return dest


def _written_text(kit: Path) -> dict[str, str]:
    """What the kit wrote in words: the Markdown and JSON (the design note and proposal too), and each
    patch's message and added lines (the proposal's drafts too)."""
    out = {p.name: p.read_text() for p in kit.rglob("*") if p.suffix in (".md", ".json")}
    out.update({p.name: patch_text_to_check(p.read_text()) for p in kit.rglob("*.patch")})
    return out


def _am(tree: Path, dest: Path, *patch_lists: list[Path]) -> Path:
    stacked = _clone(tree, dest)
    _git(stacked, "config", "core.autocrlf", "false")
    # --keep-non-patch keeps "[dynamo]" in the subject (plain `git am` strips every leading [...]);
    # --keep-cr: git am drops the CRs of CRLF lines unless told not to.
    _git(stacked, "am", "-q", "--keep-non-patch", "--keep-cr", *(str(p) for ps in patch_lists for p in ps))
    return stacked


def test_kit_writes_a_stack_of_one_commit_per_concern(main_tree, tmp_path, capsys):
    head = _git(main_tree, "rev-parse", "HEAD").strip()
    kit = tmp_path / "kit"
    args = ["patches", "upstream", "--pytorch-src", str(main_tree), "--out", str(kit), "--no-run", "--no-instructions"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert re.search(r"fx-tracing-flag-legacy-attribute\s+kept-out", printed.out)
    assert re.search(r"config-process-defaults\s+proposed", printed.out)
    for name in ("fx-node-meta-thread-local", "export-deserializer-thread-local", "cold-start-import-order"):
        assert re.search(rf"{name}\s+kept-out", printed.out), name
    assert "NOT MEASURED" in printed.err or "without instruction counts" in printed.err
    patches = sorted((kit / "patches").glob("*.patch"))
    # On main the FX tracing flag is upstream, and the config change is a design proposal.
    assert len(patches) == 4
    # The checkout is untouched.
    assert _git(main_tree, "rev-parse", "HEAD").strip() == head and _git(main_tree, "status", "--porcelain") == ""

    stacked = _am(main_tree, tmp_path / "am", patches)
    subjects = _git(stacked, "log", "--format=%s", f"{head}..HEAD").splitlines()[::-1]
    assert [s.split("] ")[0] + "]" for s in subjects] == ["[autograd]", "[fx]", "[dynamo]", "[dynamo]"]
    for patch in patches:
        message = patch.read_text().split("\n---\n")[0]
        assert "\nTest Plan:\npython test/" in message
        assert re.search(r"\n(Fixes|Part of) #\d+(\n|$)", message), patch.name
        paragraphs = [p for p in message.split("\n\n")[1:] if p.strip()]
        assert len(paragraphs) >= 4, f"{patch.name}: problem, how, test plan and links expected"
        # No commit of the stack touches config: that is the proposal's.
        assert "torch/utils/_config_module.py" not in patch.read_text(), patch.name

    # Tests sit where PyTorch's CI runs them.
    test_fx = (stacked / "test" / "test_fx.py").read_text()
    assert "from fx.test_fx_patcher_threads import TestFxPatcherThreads  # noqa: F401" in test_fx
    assert (
        test_fx.index("fx.test_cse_pass")
        < test_fx.index("fx.test_fx_patcher_threads")
        < test_fx.index("fx.test_matcher_utils")
    )
    assert (stacked / "test" / "fx" / "test_fx_patcher_threads.py").is_file()
    # test/autograd runs through test/test_autograd.py too (run_test.py skips the folder).
    test_autograd = (stacked / "test" / "test_autograd.py").read_text()
    line = "from autograd.test_launch_context import TestLaunchContext  # noqa: F401"
    assert (
        test_autograd.index("autograd.test_functional")
        < test_autograd.index(line)
        < test_autograd.index("autograd.test_logging")
    )
    compile_tests = (stacked / "test" / "dynamo" / "test_compile.py").read_text()
    assert (
        "class CompileSessionFlagsThreadTests(" in compile_tests and "class CompileWrapperThreadTests(" in compile_tests
    )
    # Merged imports go where usort puts them: the standard library before torch.
    assert "import threading\n\nimport torch\n" in compile_tests
    for test_file in _git(stacked, "ls-files", "test").split():
        compile((stacked / test_file).read_text(), test_file, "exec")

    assert len(list((kit / "pr").glob("*.md"))) == 4
    for description in (kit / "pr").glob("*.md"):
        body = description.read_text()
        for section in ("## Summary", "## Test plan", "## BC-breaking notes", "## Benchmark", "## Related"):
            assert section in body, (description.name, section)
        assert "NOT MEASURED" in body  # made without instruction counts: a draft
    cover = (kit / "COVER.md").read_text()
    assert "#196637" in cover and "#187589 (closed without merging)" in cover and "#118260" in cover
    assert "stack check" in cover and "rfc/config-assignments-process-wide.md" in cover
    design = (kit / "DESIGN.md").read_text()
    for shared in ("set_stance", "_CURRENT_MAKE_FX_TRACER", "fullgraph counters", "Inductor's caches", "3.14t"):
        assert shared in design, shared
    assert {name: found for name, body in _written_text(kit).items() if (found := internal_references(body))} == {}


def test_config_change_is_a_design_proposal_drafted_on_top_of_the_stack(main_tree, tmp_path):
    kit = tmp_path / "kit"
    reports = {r.name: r for r in make_kit(main_tree, kit, run=False)}
    assert reports["config-process-defaults"].state == PROPOSED
    assert reports["internal-config-overrides-thread-local"].state == PROPOSED
    rfc = (kit / "rfc" / "config-assignments-process-wide.md").read_text()
    for needed in ("#186537", "#173568", "#118387", "## Options", "## Proposed semantics", "## BC impact"):
        assert needed in rfc, needed
    # The test changes it needs are shown, with the tearDown that clears the process-wide values.
    assert "def test_get_hash_per_thread_isolation(self):" in rfc and "config.reset_process_overrides()" in rfc
    drafts = sorted((kit / "rfc" / "config-assignments-process-wide").glob("*.patch"))
    assert len(drafts) == 2 and all(d.name in rfc for d in drafts)
    stacked = _am(main_tree, tmp_path / "am", sorted((kit / "patches").glob("*.patch")), drafts)
    config_module = (stacked / "test" / "test_utils_config_module.py").read_text()
    assert "config.reset_process_overrides()" in config_module
    assert "with config.patch(e_int=999):" in config_module
    for draft in drafts:
        # The assertion that one patch object entered from two threads used to hit is gone upstream.
        assert "prior should be empty when entering" not in draft.read_text()


@pytest.mark.parametrize("version", ["2.13.0", "2.15.0"])
def test_release_trees_are_refused(tmp_path, capsys, version):
    tree = _make_tree(tmp_path / "pytorch", version)
    with pytest.raises(UpstreamKitError, match="release tree") as error:
        make_kit(tree, tmp_path / "kit", run=False)
    assert "startup hook" in str(error.value) and "dflash patches build-wheel" in str(error.value)
    assert main(["patches", "upstream", "--pytorch-src", str(tree), "--out", str(tmp_path / "kit2")]) == 1
    assert "main checkout only" in capsys.readouterr().err
    assert not (tmp_path / "kit2" / "patches").exists()


def test_internal_references_are_found():
    for leak in (
        "see torch_races.md",
        "dflash patches verify",
        "Variant for 2.15 (typed signatures)",
        "race (class C)",
        "classes A, B",
        "/srv/shared/notes.md",
        "/work/notes.md",
        "torch 2.13 holds the flag",
        "checked on a torch 2.13 interpreter",
        # Release-bound wording: the kit is for main.
        "Backport of the thread-local flag of torch 2.14",
        "Not applicable to 2.5",
        "This is the change of #168999 for a release branch",
        "Since 2.12 the stash is there",
        "per-thread in C on this tree",
        "for 2.13 and later",
        "the reader falls back (0000-autograd-launch-context)",
    ):
        assert internal_references(leak), leak
    assert internal_references("Fixes #186537; compile_wrapper takes no lock") == []
    assert internal_references("Made for PyTorch main (version 2.16.0a0): 0001-autograd-Read.patch") == []


def test_leaking_or_stale_text_stops_the_kit(main_tree, tmp_path, monkeypatch):
    original = concerns_module.CONCERNS
    for bad in ("see class A", "Backport of the thread-local flag of torch 2.14"):
        leaking = tuple(c.__class__(**{**c.__dict__, "bc": (bad,)}) for c in original)
        monkeypatch.setattr("dflash.patchtools.upstream.kit.CONCERNS", leaking)
        with pytest.raises(UpstreamKitError, match="project-internal or release-bound text"):
            make_kit(main_tree, tmp_path / f"kit-{len(bad)}", run=False)
    stale = tuple(c.__class__(**{**c.__dict__, "bc": ("`_no_such_function` is gone",)}) for c in original)
    monkeypatch.setattr("dflash.patchtools.upstream.kit.CONCERNS", stale)
    with pytest.raises(UpstreamKitError, match="_no_such_function"):
        make_kit(main_tree, tmp_path / "kit2", run=False)


def test_a_series_concern_without_upstream_text_stops_the_kit(main_tree, tmp_path, monkeypatch):
    without = tuple(c for c in concerns_module.CONCERNS if c.name != "export-deserializer-thread-local")
    monkeypatch.setattr("dflash.patchtools.upstream.kit.CONCERNS", without)
    with pytest.raises(UpstreamKitError, match="export-deserializer-thread-local"):
        make_kit(main_tree, tmp_path / "kit", run=False)


def test_crlf_files_are_reported(tmp_path):
    if not (SOURCES / "2.15.0" / "torch").is_dir():
        pytest.skip("needs the 2.15.0 sources in DFLASH_TORCH_SOURCES (scripts/fetch_torch_sources.py --series)")
    tree = _make_tree(
        tmp_path / "pytorch", "2.16.0a0", crlf="torch/_dynamo/utils.py", torch_dir=SOURCES / "2.15.0" / "torch"
    )
    reports = {r.name: r for r in make_kit(tree, tmp_path / "kit", run=False)}
    # Main has the thread-local FX flag (#168999); the newest patches claim every later release
    # (Torch-Versions ">=2.12"), so main gets them, applied exactly or reported.
    assert reports["fx-tracing-flag-thread-local"].state == "upstream"
    assert reports["fx-tracing-flag-legacy-attribute"].state == KEPT_OUT
    assert reports["fx-patcher-thread-isolation"].state == REBASED
    assert any("CRLF" in n for r in reports.values() for n in r.notes)
    stacked = _am(tree, tmp_path / "am", sorted((tmp_path / "kit" / "patches").glob("*.patch")))
    utils = (stacked / "torch" / "_dynamo" / "utils.py").read_bytes()
    assert b"_error_on_graph_break_var" in utils and b"\r\n" in utils and b"\n" not in utils.replace(b"\r\n", b"")


def _compile_wrapper_commit(kit: Path) -> tuple[str, str]:
    """(the compile-wrapper-guard commit's patch file, its PR description) in a kit."""
    patch = next(p for p in (kit / "patches").glob("*.patch") if "error_on_graph_break" in p.name)
    return patch.read_text(), (kit / "pr" / f"{patch.stem}.md").read_text()


def test_main_with_per_thread_eval_frame_settings_gets_only_the_per_thread_error_on_graph_break(main_tree, tmp_path):
    # On main the eval-frame settings are per-thread in C: the commit must not carry the shared gate,
    # nor the isolate-recompiles test that polls with a time limit.
    make_kit(main_tree, tmp_path / "kit", run=False)
    patch, pr = _compile_wrapper_commit(tmp_path / "kit")
    changed = re.findall(r"^diff --git a/(\S+)", patch, flags=re.M)
    assert changed == ["test/dynamo/test_compile.py", "torch/_dynamo/decorators.py", "torch/_dynamo/utils.py"], changed
    assert re.search(r"\nSubject: \[PATCH (\d)/\1\] \[dynamo\] Make error_on_graph_break thread-local\n", patch)
    assert "_SharedEvalFrameSettings" not in patch and "EvalFrameSettingsThreadTests" not in patch
    assert "+class CompileWrapperThreadTests(" in patch and "time.sleep" not in patch
    assert "per-thread in C (`Py_tss_t` slots" in patch and "per-thread in C (`Py_tss_t` slots" in pr
    assert "waits until no other thread" not in pr  # the gate's BC note


def test_main_with_shared_eval_frame_settings_gets_the_gate(installed_main_tree, tmp_path):
    if Version(INSTALLED_RELEASE) >= Version("2.15"):
        pytest.skip("the installed torch keeps the eval-frame settings per thread")
    make_kit(installed_main_tree, tmp_path / "kit", run=False)
    patch, pr = _compile_wrapper_commit(tmp_path / "kit")
    assert "torch/_dynamo/eval_frame.py" in patch and "_SharedEvalFrameSettings" in patch
    assert "+class CompileWrapperThreadTests(" in patch and "+class EvalFrameSettingsThreadTests(" in patch
    assert "share eval-frame settings across threads" in pr and "waits until no other thread" in pr


UPSTREAM_TESTS = Path(importlib.util.find_spec("dflash.patchtools").submodule_search_locations[0]) / "upstream_tests"


def test_upstream_test_threads_cannot_hang_a_run():
    # A regression must fail the test, not hang it: every worker thread is a daemon, and every
    # function that joins one (with a timeout) then checks that it has ended.
    for source in sorted(UPSTREAM_TESTS.rglob("*.py")):
        tree = ast.parse(source.read_text())
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if ast.unparse(call.func) == "threading.Thread":
                assert any(k.arg == "daemon" and ast.unparse(k.value) == "True" for k in call.keywords), (
                    f"{source.name}:{call.lineno}: a worker thread that is not a daemon"
                )
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            joins = [
                n
                for n in ast.walk(func)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "join"
                and ast.unparse(n.func.value) not in ("self", "os.path")  # thread joins only
            ]
            for join in joins:
                assert join.args, f"{source.name}:{join.lineno}: join() without a timeout"
                assert "is_alive" in ast.unparse(func), (
                    f"{source.name}:{join.lineno}: join() not followed by is_alive()"
                )


def test_upstream_read_in_thread_raises_the_threads_exception():
    spec = importlib.util.spec_from_file_location(
        "upstream_config_threads", UPSTREAM_TESTS / "dynamo" / "test_config_threads.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.read_in_thread(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        module.read_in_thread(lambda: 1 / 0)


def test_kit_detects_fixes_already_in_the_tree(main_tree, tmp_path):
    make_kit(main_tree, tmp_path / "kit", run=False)
    patches = sorted((tmp_path / "kit" / "patches").glob("*.patch"))
    _git(main_tree, "am", "-q", "--keep-non-patch", *map(str, patches))
    reports = make_kit(main_tree, tmp_path / "again", run=False)
    assert not [r for r in reports if r.state == REBASED]
    assert len([r for r in reports if r.state == PRESENT]) == len(patches)
    assert len([r for r in reports if r.state == PROPOSED]) == 2  # still drafted on top


def test_verdicts():
    assert (
        verdict([{"test": "a", "without": "fail", "with": "pass"}, {"test": "b", "without": "pass", "with": "pass"}])
        == SHOWN
    )
    assert verdict([{"test": "a", "without": "pass", "with": "pass"}]) == PASSES_WITHOUT
    assert verdict([{"test": "a", "without": "fail", "with": "fail"}]) != SHOWN
    assert verdict([]) != SHOWN


def test_stack_check_finds_a_commit_that_needs_a_later_one(monkeypatch, tmp_path):
    # Commit 1 fixes A; commit 2 fixes B but breaks A's test; commit 3's test needs commit 4.
    def concern(name, cls):
        return concerns_module.UpstreamConcern(
            name=name, area="x", title=name, problem="", tests=(concerns_module.TestPlacement(cls, f"test/{cls}.py"),)
        )

    commits = [
        kit_module.Commit(concern(n, cls), None, {f"torch/{n}.py": n}, {f"test/{cls}.py": cls}, [])
        for n, cls in (("one", "TestA"), ("two", "TestB"), ("three", "TestC"))
    ]
    monkeypatch.setattr(kit_module, "_test_targets", lambda c: [(c.tests[0].target, [c.tests[0].source])])
    monkeypatch.setattr(runs, "lay_out", lambda state, *args: set(state))

    def run_tests(python, root, path, classes):
        passes = {"TestA": "torch/one.py" in root and "torch/two.py" not in root, "TestB": "torch/two.py" in root}
        passes["TestC"] = "torch/four.py" in root  # never: commit 4 is not in the stack
        return runs.RunResult({f"{c}.test": ("pass" if passes[c] else "fail", "") for c in classes})

    monkeypatch.setattr(runs, "run_tests", run_tests)
    results = kit_module._run_stack(commits, kit_module._states(commits), None, tmp_path, "python", tmp_path)
    assert [r["verdict"] for r in results] == [SHOWN, SHOWN, "FAILS WITH THE FIX"]
    assert [r["stack"] for r in results] == [STACK_PASSES, STACK_FAILS, STACK_FAILS]
    assert results[1]["stack_rows"] == [{"test": "TestA.test", "commit": 1, "outcome": "fail"}]


@pytest.mark.skipif(importlib.util.find_spec("expecttest") is None, reason="PyTorch's tests need expecttest")
def test_each_commit_passes_its_tests_alone_and_fails_without_its_fix(installed_main_tree, tmp_path):
    # The kit's stack check: each commit's tests, and those of the commits below it, pass on the tree
    # with those commits only; each commit's own tests fail without it.
    reports = make_kit(installed_main_tree, tmp_path / "kit", instructions=False)
    record = json.loads((tmp_path / "kit" / "runs.json").read_text())
    assert {r.name: r.verdict for r in reports if r.state == REBASED} == {
        c["concern"]: SHOWN for c in record["commits"]
    }
    assert {r.name: r.stack for r in reports if r.state == REBASED} == {
        c["concern"]: STACK_PASSES for c in record["commits"]
    }
    assert record["tree_differs_from_torch_in"] == []
    for k, commit in enumerate(record["commits"], start=1):
        assert any(t["without"] in ("fail", "error") for t in commit["rows"]), commit["concern"]
        assert all(t["with"] == "pass" for t in commit["rows"]), commit["concern"]
        assert {r["commit"] for r in commit["stack_rows"]} <= set(range(1, k)), commit["concern"]
        assert all(r["outcome"] == "pass" for r in commit["stack_rows"]), commit["concern"]
    assert len(record["commits"][-1]["stack_rows"]) >= len(record["commits"]) - 1


def test_benchmark_numbers_come_from_the_json(main_tree, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "torch": "2.13.0+cpu",
                "backend": "eager",
                "calls_per_s_1_threads": {
                    "plain": 51234.0,
                    "patched": 50987.0,
                    "ratio": 0.9952,
                    "ratio_ci95": [0.9901, 0.9987],
                },
                "calls_per_s_4_threads": {"plain": 60111.0, "patched": 59876.0, "ratio": 0.9961},
            }
        )
    )
    make_kit(main_tree, tmp_path / "kit", run=False, benchmark_json=bench)
    for description in (tmp_path / "kit" / "pr").glob("*.md"):
        body = description.read_text()
        assert "| 1 | 51,234 | 50,987 | 0.995 (95% CI 0.990 to 0.999) |" in body
        assert "| 4 | 60,111 | 59,876 | 0.996 |" in body
    bench.write_text(json.dumps({"torch": "2.13.0"}))
    with pytest.raises(UpstreamKitError, match="no calls_per_s_<N>_threads entries"):
        make_kit(main_tree, tmp_path / "kit2", run=False, benchmark_json=bench)


def test_kit_tests_and_imports_keep_pytorchs_lint(main_tree, tmp_path):
    # The test sources: 88 columns, imports in usort's order.
    for source in sorted(UPSTREAM_TESTS.rglob("*.py")):
        text = source.read_text()
        assert max(len(line) for line in text.splitlines()) <= lint.MAX_COLUMNS, source.name
        assert lint.import_order_problems(text) == [], source.name
    # The commits: no noqa comment for E402 (which PyTorch's flake8 ignores), no repeated import.
    make_kit(main_tree, tmp_path / "kit", run=False)
    for patch in sorted((tmp_path / "kit" / "patches").glob("*.patch")) + sorted(
        (tmp_path / "kit" / "rfc").rglob("*.patch")
    ):
        assert "noqa: E402" not in patch.read_text(), patch.name
    # An import added below `import torch` goes where usort puts it: with the standard library.
    autograd = next((tmp_path / "kit" / "patches").glob("*-autograd-*.patch")).read_text()
    assert "+import contextlib\n import copyreg\n" in autograd and " import sys\n+import threading\n" in autograd
    fx = next((tmp_path / "kit" / "patches").glob("*-fx-*.patch")).read_text()
    assert "+import threading\n" not in fx.split("diff --git a/torch/fx/_symbolic_trace.py")[1].split("diff --git")[0]


def test_imports_are_tidied_and_merged_where_usort_puts_them():
    old = "import threading\n\nimport torch\n\n\ndef f():\n    pass\n"
    new = old + "\n\nimport contextvars  # noqa: E402\nimport threading  # noqa: E402\n\nX = 1\n"
    tidied = lint.tidy_imports(new, old)
    assert "import contextvars\n" in tidied and tidied.count("import threading") == 1 and "noqa" not in tidied
    target = '# Owner(s): ["module: dynamo"]\n\nimport torch\nimport torch._dynamo.test_case\n\n\nclass T:\n    pass\n'
    tests = "import threading\nimport unittest\n\nimport torch\n\n\nclass U(unittest.TestCase):\n    x = threading\n"
    merged = merge_tests(target, tests, "test/dynamo/test_x.py")
    assert merged.startswith(
        '# Owner(s): ["module: dynamo"]\n\nimport threading\nimport unittest\n\nimport torch\nimport torch._dynamo'
    ), merged
    assert lint.import_order_problems(merged) == []
    assert lint.problems("test/dynamo/test_x.py", target, merged + "y = '" + "a" * 90 + "'\n")


def test_tree_release_reads_version_txt_or_version_py(tmp_path):
    (tmp_path / "torch").mkdir()
    with pytest.raises(UpstreamKitError, match="no version.txt nor torch/version.py"):
        tree_release(tmp_path)
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.16.0a0+git1234'\n")
    assert tree_release(tmp_path) == "2.16.0a0+git1234"
    (tmp_path / "version.txt").write_text("2.16.0a0\n")
    assert tree_release(tmp_path) == "2.16.0a0"


def test_bad_trees_are_named(tmp_path):
    with pytest.raises(UpstreamKitError, match="no torch/ folder"):
        make_kit(tmp_path, tmp_path / "kit")
    (tmp_path / "torch").mkdir()
    (tmp_path / "version.txt").write_text("2.16.0a0\n")
    with pytest.raises(UpstreamKitError, match="git rev-parse"):
        make_kit(tmp_path, tmp_path / "kit")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "--allow-empty", "-m", "x")
    (tmp_path / "version.txt").write_text("not-a-version\n")
    with pytest.raises(UpstreamKitError, match="not a PEP 440 version"):
        make_kit(tmp_path, tmp_path / "kit")
