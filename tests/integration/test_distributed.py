"""The threaded engine under torchrun: two CPU processes (gloo) share the regeneration of the
replies, end with identical drafter weights, only rank 0 writes checkpoints, and a checkpoint of a
2-process run resumes exactly. A barrier with a timeout outwaits the default group's."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tiny import make_target, write_chat_data

from dflash.run.step_dirs import find_checkpoint

WORKER = """
import json, sys, torch
from dflash.config import TrainConfig
from dflash.run.settle import settle
from dflash.train.trainer import Trainer
config = TrainConfig(**json.loads(sys.argv[1]))
trainer = Trainer(settle(config))
trainer.train()
torch.save(trainer.drafter.state_dict(), f"{config.out}-rank{trainer.process.rank}.pt")  # beside the run
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
    # Here, not at the top: the barrier test's spawned processes import this module, and this
    # import brings transformers (4 CPU-seconds in each of them).
    from dflash.run.checkpoint import load_drafter_files

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
        responses="target",
        regenerate_max_new_tokens=4,
    )
    _torchrun(tmp_path, config)
    full = tmp_path / "full"
    # Each process regenerated half of the 16 conversations; rank 0 joined the halves.
    assert sorted(p.name for p in full.glob("regenerated_train*")) == [
        "regenerated_train.jsonl",
        "regenerated_train.jsonl.key.json",
    ]
    assert len((full / "regenerated_train.jsonl").read_text().splitlines()) == 16
    rank0, rank1 = torch.load(tmp_path / "full-rank0.pt"), torch.load(tmp_path / "full-rank1.pt")
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
    resumed = torch.load(tmp_path / "full-rank1.pt")
    assert find_checkpoint(full).name == "step_00000004"
    for name in rank0:
        assert torch.equal(resumed[name], rank0[name]), name


def _late_barrier(rank: int, init_file: str, timeout_s: float | None) -> None:
    import datetime
    import time

    import torch.distributed as dist

    from dflash.distributed import barrier

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3)
    )
    if rank == 1:
        time.sleep(8)  # finishes its share late
    barrier(timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
    dist.destroy_process_group()


@pytest.mark.parametrize("timeout_s", [None, 120])
def test_a_barrier_with_a_timeout_outwaits_the_default_group(tmp_path, timeout_s):
    args = (str(tmp_path / "init"), timeout_s)
    if timeout_s is None:  # the default group's 3 s run out while rank 1 is still busy
        with pytest.raises(torch.multiprocessing.ProcessRaisedException):
            torch.multiprocessing.spawn(_late_barrier, args=args, nprocs=2, join=True)
    else:
        torch.multiprocessing.spawn(_late_barrier, args=args, nprocs=2, join=True)
