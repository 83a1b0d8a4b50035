"""Triton's autotune results travel with the run (dflash/run/compile_cache.py): what one host tuned
is put where another host's Triton looks for it, without overwriting that host's own results."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import types

import pytest
import torch

from dflash.run import compile_cache
from dflash.run.layout import AUTOTUNE_NAME, is_run_file

KEY = base64.b32encode(hashlib.sha256(b"tuning key").digest()).decode().rstrip("=")  # as Triton names them


def _host(monkeypatch, directory):
    monkeypatch.setattr(compile_cache, "triton_cache_dir", lambda: directory)


def _tuned(cache_dir, key: str, kernel: str, best: int) -> str:
    text = json.dumps({"key": [128, "torch.bfloat16"], "configs_timings": [[{"num_warps": best}, [1.0]]]})
    (cache_dir / key).mkdir(parents=True, exist_ok=True)
    (cache_dir / key / f"{kernel}.autotune.json").write_text(text)
    return text


def test_a_resume_on_another_host_finds_the_first_hosts_results(tmp_path, monkeypatch):
    first, second, out = tmp_path / "host-a", tmp_path / "host-b", tmp_path / "run"
    out.mkdir()
    tuned = {
        f"{KEY}/chunk_fwd_kernel_o.autotune.json": _tuned(first, KEY, "chunk_fwd_kernel_o", 4),
        "b" * 64 + "/causal_conv1d_fwd_kernel.autotune.json": _tuned(first, "b" * 64, "causal_conv1d_fwd_kernel", 8),
    }
    (first / ("c" * 64)).mkdir()  # a compiled kernel's directory holds no autotune result
    (first / ("c" * 64) / "kernel.cubin").write_bytes(b"\0")
    _host(monkeypatch, first)
    assert compile_cache.save_autotune(out) == 2
    assert is_run_file(AUTOTUNE_NAME)

    own = _tuned(second, KEY, "chunk_fwd_kernel_o", 2)  # the second host tuned this key itself
    _host(monkeypatch, second)
    assert compile_cache.load_autotune(out) == 1
    got = {p.relative_to(second).as_posix(): p.read_text() for p in second.glob("*/*.autotune.json")}
    assert got == {**tuned, f"{KEY}/chunk_fwd_kernel_o.autotune.json": own}


def test_entries_outside_a_key_directory_are_skipped_and_named(tmp_path, monkeypatch, caplog):
    cache_dir, out = tmp_path / "cache", tmp_path / "run"
    out.mkdir()
    (out / AUTOTUNE_NAME).write_text(
        json.dumps(
            {"../escape.autotune.json": "{}", f"{KEY}/sub/deep.autotune.json": "{}", f"{KEY}/k.autotune.json": "{}"}
        )
    )
    _host(monkeypatch, cache_dir)
    with caplog.at_level(logging.WARNING, logger="dflash.run.compile_cache"):
        assert compile_cache.load_autotune(out) == 1
    assert "'../escape.autotune.json' skipped" in caplog.text and "deep.autotune.json' skipped" in caplog.text
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.autotune.json")] == [
        f"cache/{KEY}/k.autotune.json"
    ]


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"k/x.autotune.json": 3}'])
def test_a_damaged_file_is_named_and_nothing_is_put_in(tmp_path, monkeypatch, caplog, content):
    cache_dir = tmp_path / "cache"
    (tmp_path / AUTOTUNE_NAME).write_text(content)
    _host(monkeypatch, cache_dir)
    with caplog.at_level(logging.WARNING, logger="dflash.run.compile_cache"):
        assert compile_cache.load_autotune(tmp_path) == 0
    assert f"{tmp_path / AUTOTUNE_NAME}: not loaded" in caplog.text and not cache_dir.exists()


def test_without_triton_nothing_is_written_or_read(tmp_path, monkeypatch):
    _host(monkeypatch, None)
    assert compile_cache.save_autotune(tmp_path) == 0 and not (tmp_path / AUTOTUNE_NAME).exists()
    (tmp_path / AUTOTUNE_NAME).write_text(json.dumps({f"{KEY}/k.autotune.json": "{}"}))
    assert compile_cache.load_autotune(tmp_path) == 0


def test_artifacts_saved_again_unchanged_are_not_written_or_logged_again(tmp_path, monkeypatch, caplog):
    """Saved after step 1 and with each checkpoint: `compile artifacts saved` was logged again for the same ones."""
    _host(monkeypatch, None)
    info = types.SimpleNamespace(artifacts={"inductor": ["a", "b"]})
    artifacts = [b"step 1", b"step 1", b"step 1 and a recompile"]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (artifacts.pop(0), info))
    with caplog.at_level(logging.INFO, logger="dflash.run.compile_cache"):
        for _ in range(3):
            compile_cache.save(tmp_path)
    assert caplog.text.count("compile artifacts saved to") == 2, caplog.text  # the first, then the changed
    assert (tmp_path / compile_cache.CACHE_NAME).read_bytes() == b"step 1 and a recompile"
