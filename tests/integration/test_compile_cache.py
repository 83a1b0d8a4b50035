"""The run's compile artifacts (dflash/run/compile_cache.py): what one process compiled is a cache
hit in a fresh process on an empty inductor cache (another host) once loaded, and a miss without
them; a damaged file is named and skipped."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

from dflash.run import compile_cache

#: Compile one function (inductor, CPU), optionally after loading ``out``'s artifacts, save them,
#: and print the FX graph cache hits and misses.
COMPILE = textwrap.dedent("""\
    import sys, torch
    from pathlib import Path
    from torch._dynamo.utils import counters
    from dflash.run import compile_cache
    out = Path(sys.argv[1])
    if sys.argv[2] == "load":
        assert compile_cache.load(out)
    step = torch.compile(lambda x: (x.sin() * 3 + x.cos()).sum(), dynamic=False)
    step(torch.randn(64))
    compile_cache.save(out)
    print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
    """)


def _compile(out, cache_dir, mode: str) -> tuple[int, int]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(out), mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hits, misses = map(int, done.stdout.split())
    return hits, misses


def test_artifacts_make_a_fresh_process_on_an_empty_cache_hit(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert _compile(out, tmp_path / "host-a", "none") == (0, 1)
    assert (out / compile_cache.CACHE_NAME).stat().st_size > 0
    assert _compile(out, tmp_path / "host-b", "load") == (1, 0)
    (tmp_path / "elsewhere").mkdir()
    assert _compile(tmp_path / "elsewhere", tmp_path / "host-c", "none")[0] == 0  # no artifacts: compiled again


def test_a_damaged_file_is_named_and_skipped(tmp_path, caplog):
    (tmp_path / compile_cache.CACHE_NAME).write_bytes(b"not a cache")
    with caplog.at_level(logging.WARNING, logger="dflash.run.compile_cache"):
        assert compile_cache.load(tmp_path) is False
    assert f"{tmp_path / compile_cache.CACHE_NAME}: not loaded" in caplog.text
    assert "compiles from nothing" in caplog.text
