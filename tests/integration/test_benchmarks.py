"""The benchmarks still run (CPU smoke runs in a subprocess; their numbers come from GPU runs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_drafter_scaling_smoke_on_cpu():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "drafter_scaling.py"), "--device", "cpu", "--size", "tiny"]
        + ["--phase", "scaling", "--steps", "2", "--warmup", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["solo"]["threads"] == 1 and result["multi"]["threads"] == 2
    assert result["multi"]["tokens_per_s_per_device"] > 0 and result["scaling"] > 0
    assert result["multi"]["eager_fallbacks"] == 0
    assert "scaling: W=2 per-device / solo" in done.stdout


def test_lm_head_loss_smoke_on_cpu():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "lm_head_loss.py"), "--device", "cpu", "--tiny", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    difference = float(done.stdout.split("gradient relative difference ")[1].split()[0])
    assert difference < 1e-5 and "fused / checkpointed time:" in done.stdout


def test_hybrid_rollback_smoke_on_cpu():
    pytest.importorskip("transformers.models.qwen3_5")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "hybrid_rollback.py"), "--tiny"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forward / mixers time per token:" in done.stdout
    assert "speculative outputs differing from greedy: 0 of" in done.stdout


def test_tokenize_cache_smoke_on_cpu():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "tokenize_cache.py"), "--chats", "300"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"before (1 process, no cache)", "after (workers, cache in --out)", "after / before"}
    first, resume = (float(value.rstrip("x")) for value in rows["after / before"])
    assert first > 0 and 0 < resume < 1  # the resume reads the cache instead of tokenizing


def test_compile_after_trace_counts_the_same_instructions_patched_and_plain():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "compile_after_trace.py"), "--rounds", "1", "--blocks", "4"]
        + ["--wall-blocks", "2", "--modules", "6", "--calls", "5", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["module_call_is_original_after_trace"] == {"plain": True, "patched": True}
    assert result["dynamo_instructions"]["ratio_median"] == 1.0, result
    assert result["eager_instructions"]["ratio_median"] == 1.0, result


def test_drafter_step_memory_names_what_is_alive_at_the_peak():
    sys.path.insert(0, str(BENCHMARKS))
    from drafter_step import peak_allocations

    frame = lambda path, line: {"filename": path, "line": line, "name": "f"}
    # A torch installed in a venv inside a checkout named dflash is not the project's code.
    venv = frame("/src/dflash/.venv/lib/torch/nn/functional.py", 3)
    layer = [frame("/tmp/torchinductor/ab/cab.py", 7), venv, frame("/src/dflash/dflash/drafter/model.py", 40)]
    loss = [frame("/src/dflash/dflash/train/loss.py", 90)]
    gib = 2**30
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": layer},
        {"action": "alloc", "addr": 2, "size": 1 * gib, "frames": loss},
        {"action": "free_requested", "addr": 2, "size": 1 * gib, "frames": loss},
        {"action": "alloc", "addr": 3, "size": 3 * gib, "frames": loss},  # the peak: 5 GiB allocated
        {"action": "free_completed", "addr": 2, "size": 1 * gib, "frames": loss},  # freed when requested
        {"action": "free_requested", "addr": 3, "size": 3 * gib, "frames": loss},
        {"action": "alloc", "addr": 4, "size": 1 * gib, "frames": [venv]},
    ]
    roots = (Path("/src/dflash/dflash"), Path("/src/dflash/benchmarks"))
    result = peak_allocations(trace, top=5, roots=roots)
    assert result["peak_gib"] == 5
    assert result["sites"] == [("dflash/train/loss.py:90 f", 3.0), ("dflash/drafter/model.py:40 f <- cab.py:7", 2.0)]
