"""The FP8 target forward on a GPU that has FP8 tensor cores (skipped elsewhere, and without
torchao): the linear layers become FP8, the tapped states stay bf16 and close to the bf16
target's, and ``dflash train --target-dtype fp8`` trains and labels its held-out acceptance.

    python -m pytest tests/integration/test_fp8_target_cuda.py -q -s
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny import make_target, write_chat_data

from dflash.target_model.fp8 import fp8_problem, quantize_target

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_problem(torch.device("cuda")) is not None,
    reason="needs an FP8-capable GPU (compute capability 8.9+) and torchao",
)


def test_fp8_linear_layers_keep_the_tapped_states_close_and_train(tmp_path):
    from dflash.cli import main
    from dflash.run import acceptance_log
    from dflash.target_model.model import load_target

    target_dir = make_target(tmp_path / "target", num_layers=8, hidden=64)
    bf16 = load_target(target_dir, device="cuda")
    fp8 = load_target(target_dir, device="cuda")
    report = quantize_target(fp8.model)
    # q, k, v, o, gate, up, down per layer; the LM head stays, as do norms (a small share of the weights).
    assert (report.layers, report.bf16_layers) == (8 * 7, 1) and 0.9 < report.weight_share < 1
    ids = torch.randint(3, 200, (2, 96), generator=torch.Generator().manual_seed(0))
    reference, states = bf16.capture(ids).context.float(), fp8.capture(ids).context
    deviation = float((states.float() - reference).norm() / reference.norm())
    print(f"tapped states, FP8 vs bf16: relative deviation {deviation:.4f}")
    assert states.dtype == torch.bfloat16 and 0 < deviation < 0.1

    flags = ["--target", str(target_dir), "--data", str(write_chat_data(tmp_path / "chats.jsonl")), "--device", "cuda"]
    flags += ["--target-dtype", "fp8", "--out", str(tmp_path / "run"), "--steps", "3", "--seq-len", "128"]
    flags += ["--batch-size", "2", "--max-anchors", "8", "--responses", "data", "--log-every", "1"]
    flags += ["--no-save", "--no-progress", "--eval-data", str(write_chat_data(tmp_path / "heldout.jsonl"))]
    flags += ["--eval-prompts", "2", "--eval-max-new-tokens", "8"]
    assert main(["train", *flags]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3] and all(math.isfinite(row["loss"]) for row in steps)
    sources = [m["source"] for m in acceptance_log.read(tmp_path / "run")]
    assert len(sources) == 2 and all("against the FP8 target" in source for source in sources), sources
