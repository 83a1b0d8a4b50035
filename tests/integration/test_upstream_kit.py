"""``dflash patches upstream``: the PyTorch stack made from the patch series.

The trees are laid out like a PyTorch checkout (``torch/...``, ``test/...``, ``version.txt``) and
committed in a temporary git repository. Their ``torch/`` files are the installed torch's own (the
files the series touches), so the kit's test runs, which borrow the installed torch's compiled parts,
test exactly that tree. Their ``test/`` files are small stand-ins with the shapes of PyTorch's
(``from fx.test_* import`` lines in ``test/test_fx.py``, a ``TestConfigModule.tearDown`` and
``test_get_hash_per_thread_isolation`` in ``test/test_utils_config_module.py``).

Integration tier: every test runs git in subprocesses (about 20 s together on 2 cores), and
``test_each_commit_fails_without_and_passes_with_its_fix`` runs every commit's tests twice in fresh
interpreters (2-8 minutes on 2 cores, depending on load; needs ``expecttest``, PyTorch's test
dependency).
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

from dflash.cli import main
from dflash.patching.series import load_series
from dflash.patchtools.upstream import (
    KEPT_OUT,
    PASSES_WITHOUT,
    PRESENT,
    REBASED,
    SHOWN,
    UpstreamKitError,
    make_kit,
    tree_release,
)
from dflash.patchtools.upstream import concerns as concerns_module
from dflash.patchtools.upstream.kit import verdict
from dflash.patchtools.upstream.text import internal_references, patch_text_to_check

TORCH_DIR = Path(torch.__file__).parent

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


@pytest.fixture
def tree(tmp_path) -> Path:
    return _make_tree(tmp_path / "pytorch", torch.__version__.split("+")[0])


def _clone(tree: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(tree), str(dest)], check=True)
    _git(dest, "config", "user.name", "Kit Tester")
    _git(dest, "config", "user.email", "kit@example.com")
    return dest


def _written_text(kit: Path) -> dict[str, str]:
    """What the kit wrote in words: the Markdown and JSON, and each patch's message and added lines."""
    out = {p.name: p.read_text() for p in kit.rglob("*") if p.suffix in (".md", ".json")}
    out.update({p.name: patch_text_to_check(p.read_text()) for p in (kit / "patches").glob("*.patch")})
    return out


def test_kit_writes_a_stack_of_one_commit_per_concern(tree, tmp_path, capsys):
    head = _git(tree, "rev-parse", "HEAD").strip()
    assert main(["patches", "upstream", "--pytorch-src", str(tree), "--out", str(tmp_path / "kit"), "--no-run"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"fx-tracing-flag-legacy-attribute\s+kept-out", printed)
    patches = sorted((tmp_path / "kit" / "patches").glob("*.patch"))
    assert len(patches) == 7
    # The checkout is untouched.
    assert _git(tree, "rev-parse", "HEAD").strip() == head and _git(tree, "status", "--porcelain") == ""

    stacked = _clone(tree, tmp_path / "am")
    # --keep-non-patch keeps "[dynamo]" in the subject (plain `git am` strips every leading [...]).
    _git(stacked, "am", "-q", "--keep-non-patch", *map(str, patches))
    subjects = _git(stacked, "log", "--format=%s", f"{head}..HEAD").splitlines()[::-1]
    assert [s.split("] ")[0] + "]" for s in subjects] == [
        "[autograd]",
        "[fx]",
        "[fx]",
        "[dynamo]",
        "[dynamo]",
        "[config]",
        "[dynamo]",
    ]
    # The internal overrides come before the config change that would otherwise leak them.
    assert "config.patch for torch's own" in subjects[4] and "process-wide" in subjects[5]
    for patch in patches:
        message = patch.read_text().split("\n---\n")[0]
        assert "\nTest Plan:\npython test/" in message
        assert re.search(r"\n(Fixes|Part of) #\d+(\n|$)", message), patch.name
        paragraphs = [p for p in message.split("\n\n")[1:] if p.strip()]
        assert len(paragraphs) >= 4, f"{patch.name}: problem, how, test plan and links expected"

    # Tests sit where PyTorch's CI runs them.
    test_fx = (stacked / "test" / "test_fx.py").read_text()
    assert "from fx.test_fx_patcher_threads import TestFxPatcherThreads  # noqa: F401" in test_fx
    assert (
        test_fx.index("fx.test_cse_pass")
        < test_fx.index("fx.test_fx_patcher_threads")
        < test_fx.index("fx.test_matcher_utils")
    )
    assert (stacked / "test" / "fx" / "test_fx_patcher_threads.py").is_file()
    assert not list((stacked / "test" / "dynamo").glob("test_thread_safety*"))
    config_tests = (stacked / "test" / "dynamo" / "test_config.py").read_text()
    assert "class ConfigThreadTests(" in config_tests and "class ConfigOverrideThreadTests(" in config_tests
    assert config_tests.index("class ConfigThreadTests(") < config_tests.index('if __name__ == "__main__":')
    config_module = (stacked / "test" / "test_utils_config_module.py").read_text()
    assert "process_override = _UNSET_SENTINEL" in config_module
    assert "with config.patch(e_int=999):" in config_module
    for test_file in _git(stacked, "ls-files", "test").split():
        compile((stacked / test_file).read_text(), test_file, "exec")

    kit = tmp_path / "kit"
    assert len(list((kit / "pr").glob("*.md"))) == 7
    for description in (kit / "pr").glob("*.md"):
        body = description.read_text()
        for section in ("## Summary", "## Test plan", "## BC-breaking notes", "## Benchmark", "## Related"):
            assert section in body, (description.name, section)
    cover = (kit / "COVER.md").read_text()
    assert "#196637" in cover and "#187589" in cover
    assert "#186537" in (kit / "patches" / patches[5].name).read_text()
    assert {name: found for name, body in _written_text(kit).items() if (found := internal_references(body))} == {}


def test_internal_references_are_found():
    for leak in (
        "see torch_races.md",
        "dflash patches verify",
        "Variant for 2.15 (typed signatures)",
        "race (class C)",
        "classes A, B",
        "../shared/notes.md",
        "torch 2.13 holds the flag",
        "checked on a torch 2.13 interpreter",
    ):
        assert internal_references(leak), leak
    assert internal_references("Fixes #186537; compile_wrapper takes no lock") == []


def test_leaking_or_stale_text_stops_the_kit(tree, tmp_path, monkeypatch):
    original = concerns_module.CONCERNS
    leaking = tuple(c.__class__(**{**c.__dict__, "bc": ("see class A",)}) for c in original)
    monkeypatch.setattr("dflash.patchtools.upstream.kit.CONCERNS", leaking)
    with pytest.raises(UpstreamKitError, match="project-internal text"):
        make_kit(tree, tmp_path / "kit", run=False)
    stale = tuple(c.__class__(**{**c.__dict__, "bc": ("`_no_such_function` is gone",)}) for c in original)
    monkeypatch.setattr("dflash.patchtools.upstream.kit.CONCERNS", stale)
    with pytest.raises(UpstreamKitError, match="_no_such_function"):
        make_kit(tree, tmp_path / "kit2", run=False)


def test_development_tree_and_crlf_files_are_reported(tmp_path):
    # A development tree: the 2.15.0 sources labelled 2.16.0a0 (the newest release's code).
    sources = Path(os.environ.get("DFLASH_TORCH_SOURCES", "/nonexistent")) / "2.15.0" / "torch"
    if not sources.is_dir():
        pytest.skip("needs the 2.15.0 sources in DFLASH_TORCH_SOURCES (scripts/fetch_torch_sources.py --series)")
    tree = _make_tree(tmp_path / "pytorch", "2.16.0a0", crlf="torch/_dynamo/utils.py", torch_dir=sources)
    reports = {r.name: r for r in make_kit(tree, tmp_path / "kit", run=False)}
    # 2.16 has the thread-local FX flag (since 2.14); the newest variants claim every later release
    # (Torch-Versions ">=2.12"), so a development tree gets them, applied exactly or reported.
    assert reports["fx-tracing-flag-thread-local"].state == "upstream"
    assert reports["fx-tracing-flag-legacy-attribute"].state == KEPT_OUT
    assert reports["fx-patcher-thread-isolation"].state == REBASED
    assert any("CRLF" in n for r in reports.values() for n in r.notes)
    patches = sorted((tmp_path / "kit" / "patches").glob("*.patch"))
    stacked = _clone(tree, tmp_path / "am")
    _git(stacked, "config", "core.autocrlf", "false")
    # --keep-cr: git am drops the CRs of CRLF lines unless told not to.
    _git(stacked, "am", "-q", "--keep-non-patch", "--keep-cr", *map(str, patches))
    utils = (stacked / "torch" / "_dynamo" / "utils.py").read_bytes()
    assert b"_error_on_graph_break_var" in utils and b"\r\n" in utils and b"\n" not in utils.replace(b"\r\n", b"")


def _compile_wrapper_commit(kit: Path) -> tuple[str, str]:
    """(the compile-wrapper-guard commit's patch file, its PR description) in a kit."""
    patch = next(p for p in (kit / "patches").glob("*.patch") if "error_on_graph_break" in p.name)
    return patch.read_text(), (kit / "pr" / f"{patch.stem}.md").read_text()


@pytest.mark.parametrize("version", ["2.15.0", "2.16.0a0"])
def test_trees_with_per_thread_eval_frame_settings_get_only_the_per_thread_error_on_graph_break(tmp_path, version):
    # From 2.15 the eval-frame settings are per-thread in C: the commit must not carry the shared gate,
    # nor the isolate-recompiles test that polls with a time limit.
    tree = _make_tree(tmp_path / "pytorch", version)
    make_kit(tree, tmp_path / "kit", run=False)
    patch, pr = _compile_wrapper_commit(tmp_path / "kit")
    changed = re.findall(r"^diff --git a/(\S+)", patch, flags=re.M)
    assert changed == ["test/dynamo/test_compile.py", "torch/_dynamo/decorators.py", "torch/_dynamo/utils.py"], changed
    assert re.search(r"\nSubject: \[PATCH (\d)/\1\] \[dynamo\] Make error_on_graph_break thread-local\n", patch)
    assert "_SharedEvalFrameSettings" not in patch and "EvalFrameSettingsThreadTests" not in patch
    assert "+class CompileWrapperThreadTests(" in patch and "time.sleep" not in patch
    assert "per-thread in C on this tree" in patch and "per-thread in C on this tree" in pr
    assert "waits until no other thread" not in pr  # the gate's BC note


def test_trees_with_shared_eval_frame_settings_get_the_gate(tree, tmp_path):
    make_kit(tree, tmp_path / "kit", run=False)
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


def test_kit_detects_fixes_already_in_the_tree(tree, tmp_path):
    make_kit(tree, tmp_path / "kit", run=False)
    _git(tree, "am", "-q", "--keep-non-patch", *map(str, sorted((tmp_path / "kit" / "patches").glob("*.patch"))))
    reports = make_kit(tree, tmp_path / "again", run=False)
    assert not [r for r in reports if r.state == REBASED]
    assert len([r for r in reports if r.state == PRESENT]) == 7


def test_verdicts():
    assert (
        verdict([{"test": "a", "without": "fail", "with": "pass"}, {"test": "b", "without": "pass", "with": "pass"}])
        == SHOWN
    )
    assert verdict([{"test": "a", "without": "pass", "with": "pass"}]) == PASSES_WITHOUT
    assert verdict([{"test": "a", "without": "fail", "with": "fail"}]) != SHOWN
    assert verdict([]) != SHOWN


@pytest.mark.skipif(importlib.util.find_spec("expecttest") is None, reason="PyTorch's tests need expecttest")
def test_each_commit_fails_without_and_passes_with_its_fix(tree, tmp_path):
    reports = make_kit(tree, tmp_path / "kit")
    record = json.loads((tmp_path / "kit" / "runs.json").read_text())
    assert {r.name: r.verdict for r in reports if r.state == REBASED} == {
        c["concern"]: SHOWN for c in record["commits"]
    }
    assert record["tree_differs_from_torch_in"] == []
    for commit in record["commits"]:
        assert any(t["without"] in ("fail", "error") for t in commit["tests"]), commit["concern"]
        assert all(t["with"] == "pass" for t in commit["tests"]), commit["concern"]


def test_benchmark_numbers_come_from_the_json(tree, tmp_path):
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
    make_kit(tree, tmp_path / "kit", run=False, benchmark_json=bench)
    for description in (tmp_path / "kit" / "pr").glob("*.md"):
        body = description.read_text()
        assert "| 1 | 51,234 | 50,987 | 0.995 (95% CI 0.990 to 0.999) |" in body
        assert "| 4 | 60,111 | 59,876 | 0.996 |" in body
    bench.write_text(json.dumps({"torch": "2.13.0"}))
    with pytest.raises(UpstreamKitError, match="no calls_per_s_<N>_threads entries"):
        make_kit(tree, tmp_path / "kit2", run=False, benchmark_json=bench)


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
