"""Packing end to end in fresh processes: the packing benchmark's CPU smoke run (`dflash train
--pack` and `--no-pack`), and HF's flex_attention target path compiled on CPU."""

import subprocess
import sys
from pathlib import Path

from tiny import capture_packed_and_alone, make_target

from dflash.target import load_target

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "packing_e2e.py"


def test_target_states_with_flex_attention_equal_each_conversation_alone(tmp_path):
    """Compiles HF's flex_attention on CPU (tens of seconds)."""
    target = load_target(make_target(tmp_path, num_layers=2), layer_ids=[0, 1], device="cpu")
    target.model.set_attn_implementation("flex_attention")
    capture_packed_and_alone(target, [5, 9, 6], seq_len=24)


def test_packing_benchmark_smoke_on_cpu(tmp_path):
    """Subprocess: `packing_e2e.py --tiny` runs `dflash train --pack` and `--no-pack` on CPU (~40 s)."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--tiny", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    table = [line.split() for line in done.stdout.splitlines() if not line.startswith("packed /")]
    rows = {cells[0]: cells for cells in table if cells[:1] in (["packed"], ["unpacked"])}
    assert set(rows) == {"packed", "unpacked"}
    assert all(float(row[1].replace(",", "")) > 0 for row in rows.values()), done.stdout
    assert "packed / unpacked: end to end" in done.stdout
    assert not list(tmp_path.iterdir()), "the benchmark removes its target, data and runs"
