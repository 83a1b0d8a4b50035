"""The patch cache never turns the patches off: every unreadable entry is a miss, recomputed and
rewritten; writes are fsynced before the rename; ``dflash patches status`` names the cache.

The first tests run in this process (a fresh finder or loader against a temp cache). The last
two start fresh interpreters (``import torch`` through the startup hook, ~5 s each).
"""

import json
import marshal
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from dflash.patching import cache
from dflash.patching.importhook import PatchedSourceLoader, PatchFinder

# Ways an entry goes bad, each applied to the file's bytes on disk: a crash or full disk
# mid-write, bit rot or another program, and bytes its decoder accepts with the wrong shape.
CORRUPTIONS = {
    "truncated": lambda data, wrong_shape: data[: len(data) // 2],
    "empty": lambda data, wrong_shape: b"",
    "garbage": lambda data, wrong_shape: b"\xff\xfe\x00garbage" * 7,
    "wrong shape": lambda data, wrong_shape: wrong_shape,
}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "faults", {}, raising=False)
    return tmp_path / "cache"


def _prepared_finder() -> PatchFinder:
    finder = PatchFinder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a PatchWarning fails the test
        finder._prepare()
    assert finder.error is None and finder.plan is not None
    return finder


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_plan_entry_is_recomputed_and_rewritten(cache_dir, corruption):
    good = _prepared_finder()
    entry = cache_dir / good.plan_key
    entry.write_bytes(CORRUPTIONS[corruption](entry.read_bytes(), b'{"release": 1}'))

    again = _prepared_finder()
    assert again.plan.to_json() == good.plan.to_json()
    assert cache.read(good.plan_key) == good.plan.to_json().encode()  # rewritten, and it verifies
    assert cache.faults[good.plan_key]["rewritten"] is True


def test_a_verified_entry_its_decoder_rejects_is_a_miss_too(cache_dir):
    good = _prepared_finder()
    cache.write(good.plan_key, b"\xff not json")
    assert _prepared_finder().plan.to_json() == good.plan.to_json()
    assert "undecodable" in cache.faults[good.plan_key]["why"]


def test_an_entry_that_cannot_be_read_is_a_miss(cache_dir):
    good = _prepared_finder()
    entry = cache_dir / good.plan_key
    entry.unlink()
    entry.mkdir()  # reading it raises IsADirectoryError, rewriting it fails
    assert _prepared_finder().plan.to_json() == good.plan.to_json()
    assert cache.faults[good.plan_key] == {"why": cache.faults[good.plan_key]["why"], "rewritten": False}
    assert "IsADirectoryError" in cache.faults[good.plan_key]["why"]


def _module_loader(finder: PatchFinder) -> tuple[PatchedSourceLoader, str]:
    import importlib.util

    module = sorted(finder.plan.module_patches)[0]
    return PatchedSourceLoader(module, importlib.util.find_spec(module).origin, finder), module


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_module_entry_is_recomputed_and_rewritten(cache_dir, corruption):
    finder = _prepared_finder()
    loader, module = _module_loader(finder)
    source, code = loader._load_patched(module)
    entries = [n for n in os.listdir(cache_dir) if n != finder.plan_key]
    [name] = [n for n in entries if (cache.read_module(n) or ("",))[0] == source]
    entry = cache_dir / name
    entry.write_bytes(CORRUPTIONS[corruption](entry.read_bytes(), marshal.dumps(42)))

    loader, _ = _module_loader(finder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = loader._load_patched(module)
    assert again is not None and again[0] == source and again[1].co_filename == code.co_filename
    assert cache.read_module(name)[0] == source
    assert cache.faults[name]["rewritten"] is True


def test_writes_are_fsynced_before_the_rename(cache_dir, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cache.write("entry", b"payload")
    # The file's data, then the rename, then the directory entry.
    assert events == [("fsync", False), ("replace", "entry"), ("fsync", True)]
    assert cache.read("entry") == b"payload"
    assert not [n for n in os.listdir(cache_dir) if n != "entry"]  # no temp file left


def test_a_write_past_the_size_limit_removes_the_oldest_entries(cache_dir, monkeypatch):
    monkeypatch.setattr(cache, "MAX_BYTES", 3 * 1100)  # three entries of 1000 bytes and a header
    for age, name in enumerate(["newer", "old", "oldest"]):
        cache.write(name, b"x" * 1000)
        os.utime(cache_dir / name, (1e9 - age * 100, 1e9 - age * 100))
    stale, fresh = cache_dir / ".tmp-crashed", cache_dir / ".tmp-writing"
    stale.write_bytes(b"half")
    os.utime(stale, (1e9, 1e9))
    fresh.write_bytes(b"half")  # another process's write in progress
    cache.write("new", b"x" * 1000)
    # Four entries do not fit: the oldest goes, the one just written stays.
    assert sorted(os.listdir(cache_dir)) == [".tmp-writing", "new", "newer", "old"]
    assert cache.read("new") == b"x" * 1000


def test_describe_names_the_directory_its_state_and_bad_entries(cache_dir, tmp_path, monkeypatch):
    assert cache.describe()["state"] == "absent" and cache.describe()["directory"] == str(cache_dir)
    cache.write("good", b"x")
    (cache_dir / "bad").write_bytes(cache._FORMAT + b"\0\0\0\0" + b"rotten payload")  # digest mismatch
    (cache_dir / "older").write_bytes(b"junk")  # no header: another version's layout, or not an entry
    report = cache.describe()
    assert (report["state"], report["entries"], report["corrupt"], report["stale"]) == ("ok", 3, ["bad"], ["older"])
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(not_a_dir))
    report = cache.describe()
    assert report["state"] == "unusable" and cache.CACHE_ENV in report["detail"]


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_status_after_a_truncated_plan_entry_names_the_cache_and_every_patch_applies(tmp_path):
    """The issue's report: a truncated decision file turned the patches off in every later process."""
    env = {cache.CACHE_ENV: str(tmp_path / "cache"), "DFLASH_PATCHES": "1"}
    first = _python("import torch", env)
    assert first.returncode == 0 and "PatchWarning" not in first.stderr, first.stderr
    plan_entry = min((tmp_path / "cache").iterdir(), key=lambda p: p.stat().st_size)  # the plan is the small one
    plan_entry.write_bytes(plan_entry.read_bytes()[:100])

    status = subprocess.run(
        [sys.executable, "-m", "dflash", "patches", "status", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert "PatchWarning" not in status.stderr and status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert {p["state"] for p in report["patches"]} <= {"applied", "not-applicable", "upstream"}
    assert report["cache"]["directory"] == str(tmp_path / "cache") and report["cache"]["state"] == "ok"
    assert report["cache"]["faults"] == {
        plan_entry.name: {"why": report["cache"]["faults"][plan_entry.name]["why"], "rewritten": True}
    }
    text = subprocess.run(
        [sys.executable, "-m", "dflash", "patches", "status"], capture_output=True, text=True, env={**os.environ, **env}
    ).stdout
    assert f"patch cache {tmp_path / 'cache'}: ok" in text


def test_status_names_the_hook_error_instead_of_torch_imported_first(tmp_path):
    env = {cache.CACHE_ENV: str(tmp_path / "cache"), "DFLASH_PATCHES": "1"}
    proc = _python(
        """\
        import json, warnings
        import dflash.patching.plan as plan
        real = plan.make_plan
        def broken(*args, **kwargs):
            raise OSError("series unreadable")
        plan.make_plan = broken
        with warnings.catch_warnings(record=True):
            import torch
        plan.make_plan = real
        from dflash.patching.status import collect
        print(json.dumps(collect()["patches"]))
        """,
        env,
    )
    assert proc.returncode == 0, proc.stderr
    reasons = {p["reason"] for p in json.loads(proc.stdout.splitlines()[-1]) if p["state"] == "failed"}
    assert reasons == {"dflash patch hook disabled: OSError('series unreadable')"}
