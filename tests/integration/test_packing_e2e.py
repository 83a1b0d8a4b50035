"""Packing end to end in a fresh process: the packing benchmark's CPU smoke run (`dflash train
--pack` and `--no-pack`)."""

import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "packing_e2e.py"


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
