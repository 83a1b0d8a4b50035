"""The threaded engine under torchrun: two CPU processes (gloo) end with identical drafter
weights, only rank 0 writes checkpoints, and a checkpoint of a 2-process run resumes exactly."""

import json
import os
import shutil
import subprocess
import sys

import torch
from tiny import make_target, write_chat_data

from dflash.checkpoint import find_checkpoint, load_drafter_files

WORKER = """
import json, sys, torch
from dflash.config import TrainConfig
from dflash.trainer import Trainer
config = TrainConfig(**json.loads(sys.argv[1]))
trainer = Trainer(config)
trainer.train()
torch.save(trainer.drafter.state_dict(), f"{config.out}/rank{trainer.process.rank}.pt")
trainer.close()
"""


def _torchrun(tmp_path, config: dict) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(script),
        json.dumps(config),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def test_two_processes_stay_identical_and_resume_exactly(tmp_path):
    target, data = make_target(tmp_path / "qwen3", num_layers=5), write_chat_data(tmp_path / "train.jsonl", repeat=4)
    config = dict(
        target=str(target),
        data=str(data),
        out=str(tmp_path / "full"),
        block_size=4,
        gamma=2.0,
        num_target_layers=2,
        seq_len=48,
        batch_size=1,
        max_anchors=6,
        steps=4,
        warmup_steps=2,
        lr=1e-2,
        save_every=2,
        keep_last=2,
        log_every=1,
        progress=False,
        seed=7,
        target_devices="cpu",
        drafter_devices="cpu:0-1",
    )
    _torchrun(tmp_path, config)
    full = tmp_path / "full"
    rank0, rank1 = torch.load(full / "rank0.pt"), torch.load(full / "rank1.pt")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    _, saved = load_drafter_files(find_checkpoint(full))
    assert find_checkpoint(full).name == "step_00000004"
    for name in saved:
        assert torch.equal(saved[name], rank0[name]), name
    state = torch.load(find_checkpoint(full) / "training_state.pt", weights_only=True)
    rngs = state["engine"]["anchor_rng"]
    assert len(rngs) == 2  # one anchor RNG per process
    assert not any(torch.equal(rngs[0], s) for s in rngs[1:])

    # Roll the run back to its step-2 checkpoint and resume: must end on the same weights, bitwise.
    shutil.rmtree(full / "checkpoints" / "step_00000004")
    (full / "checkpoints" / "latest").write_text("step_00000002\n")
    _torchrun(tmp_path, {**config, "resume": True})
    resumed = torch.load(full / "rank1.pt")
    assert find_checkpoint(full).name == "step_00000004"
    for name in rank0:
        assert torch.equal(resumed[name], rank0[name]), name
