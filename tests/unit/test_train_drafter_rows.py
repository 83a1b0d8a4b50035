"""dflash.train.drafter_rows: a micro-batch's rows through the drafter in groups (--drafter-rows) give
the whole micro-batch's step, normalised over the whole step; a first step that runs out of GPU
memory in the drafter is retried with half the rows and trains as a run started there; a later one
ends with the message."""

import threading

import pytest
import torch
from tiny import make_target, record_losses, train_config, write_chat_data

import dflash.train.step
from dflash.cli import main
from dflash.compile_watch import CompiledRegion, StepWatch
from dflash.config import TrainConfig
from dflash.run.out_of_memory import out_of_memory_error
from dflash.run.settle import settle
from dflash.train.drafter_rows import fewer_rows, row_counts
from dflash.train.step import StatsLayout
from dflash.train.trainer import Trainer

OOM = "CUDA out of memory. Tried to allocate 2.37 GiB. GPU 0 has a total capacity of 79.1 GiB"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    return {"target": make_target(root / "qwen3", num_layers=5), "data": write_chat_data(root / "train.jsonl")}


def _config(assets, out, **overrides):
    # Packed rows (the default) of 4 per micro-batch: the rows hold different numbers of documents
    # and supervised slots, so each group of 2 has a normaliser of its own.
    values = dict(batch_size=4, max_anchors=4, grad_clip=0.0, steps=1, save=False)
    return train_config(target=assets["target"], data=assets["data"], out=out, **{**values, **overrides})


def _recording_group_weights(monkeypatch) -> list[float]:
    """The normaliser (position-weight sum) of each drafter forward from now on."""
    weights = []
    real = dflash.train.step._drafter_step

    def recording(*args):
        stats = real(*args)
        weights.append(stats[StatsLayout.WEIGHT].item())
        return stats

    monkeypatch.setattr(dflash.train.step, "_drafter_step", recording)
    return weights


@pytest.mark.parametrize(
    "flags",
    [
        dict(arch="dflash"),
        dict(arch="dflash", dpace=True, soft_label_weight=0.3, loss_chunk_blocks=1),
        dict(arch="dflash2"),
        dict(arch="dflash2", selector_target="soft", selector_missing_gold="exclude"),
    ],
    ids=["dflash", "dflash-dpace-soft", "dflash2", "dflash2-soft-selector"],
)
def test_groups_of_rows_give_the_whole_micro_batch_step(assets, tmp_path, monkeypatch, flags):
    whole = Trainer(settle(_config(assets, tmp_path / "whole", **flags)))
    split = Trainer(settle(_config(assets, tmp_path / "split", drafter_rows=2, **flags)))
    a = whole.engine.run(1, lr=1e-2)
    weights = _recording_group_weights(monkeypatch)
    b = split.engine.run(1, lr=1e-2)
    # Two groups with normalisers of their own: a split that divided by each would differ.
    assert len(weights) == 2 and abs(weights[0] - weights[1]) > 0.1 * max(weights)
    # The unnormalised gradient sums and every statistic (counts exact, sums up to float order).
    grads = whole.engine.replica.flat.buffer, split.engine.replica.flat.buffer
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    # Every logged figure but the timed ones (tok/s is these tokens over each run's own seconds).
    assert (a.selector_loss is None, b.selector_loss is None) == (flags["arch"] == "dflash",) * 2
    for name in ("loss", "grad_norm", "tau_hat", "flops") + ("selector_loss",) * (flags["arch"] == "dflash2"):
        assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-5), name
    assert b.acc == pytest.approx(a.acc, rel=1e-6)
    assert (b.tokens, b.row_tokens, b.draft_tokens) == (a.tokens, a.row_tokens, a.draft_tokens)
    for (name, p), q in zip(whole.drafter.named_parameters(), split.drafter.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def _out_of_memory_at(calls: set[int], monkeypatch) -> None:
    """Each thread's drafter forwards numbered ``calls`` (1-based, per thread) raise CUDA's error."""
    real = dflash.train.step._drafter_step
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def failing(*args):
        name = threading.current_thread().name
        with lock:
            counts[name] = counts.get(name, 0) + 1
            call = counts[name]
        if call in calls:
            raise torch.OutOfMemoryError(OOM)
        return real(*args)

    monkeypatch.setattr(dflash.train.step, "_drafter_step", failing)


THREADED = dict(target_devices="cpu", drafter_devices="cpu:0-1")


@pytest.mark.parametrize("layout", [{}, THREADED], ids=["local", "threaded"])
def test_a_first_step_out_of_memory_trains_as_the_run_started_at_half_the_rows(
    assets, tmp_path, monkeypatch, caplog, layout
):
    # The second micro-batch of step 1 fails, after the first has put its gradients in the buffer:
    # the retry starts from zero gradients, on the same micro-batches (the threaded engine's taken
    # from its inbox already).
    flags = dict(grad_accum=2, steps=3, **layout)
    started = record_losses(Trainer(settle(_config(assets, tmp_path / "started", drafter_rows=2, **flags))))
    started.train()
    with monkeypatch.context() as patch:
        _out_of_memory_at({2}, patch)
        retried = record_losses(Trainer(settle(_config(assets, tmp_path / "retried", **flags))))
        retried.train()
    assert retried.losses == started.losses and len(started.losses) == 3
    for (name, p), q in zip(started.drafter.named_parameters(), retried.drafter.parameters()):
        assert torch.equal(p, q), name
    replicas = ["drafter0 (cpu)"] if not layout else ["drafter0 (cpu:0)", "drafter1 (cpu:1)"]
    warnings = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert sorted(warnings) == [
        f"{replica} step 1: out of GPU memory in the drafter's forward/backward at 4 rows per forward (an "
        "allocation of 2.37 GiB failed); retrying the step on the same micro-batches at 2 rows per forward, the "
        "same training (--drafter-rows 2 starts there)"
        for replica in replicas
    ]


@pytest.mark.parametrize("layout", [{}, THREADED], ids=["local", "threaded"])
def test_a_resume_keeps_the_rows_the_first_step_settled_on(assets, tmp_path, monkeypatch, caplog, layout):
    # Step 1 retried at 2 rows, stopped after step 2: the resumed run starts at 2 rows, not at the
    # whole micro-batch (which would run out again, or sum in another order).
    flags = dict(grad_accum=2, steps=4, save=True, save_every=1, **layout)
    with monkeypatch.context() as patch:
        _out_of_memory_at({2}, patch)
        reference = record_losses(Trainer(settle(_config(assets, tmp_path / "full", **flags))))
        reference.train()
    with monkeypatch.context() as patch:
        _out_of_memory_at({2}, patch)
        first = record_losses(Trainer(settle(_config(assets, tmp_path / "split", **flags))), crash_after=2)
        with pytest.raises(KeyboardInterrupt):
            first.train()
    caplog.clear()
    forwards = _recording_group_weights(monkeypatch)
    resumed = record_losses(Trainer(settle(_config(assets, tmp_path / "split", resume=True, **flags))))
    assert resumed.step == 2
    resumed.train()
    assert "retrying" not in caplog.text
    replicas = 1 if not layout else 2
    assert len(forwards) == 2 * 2 * 2 * replicas  # 2 steps x 2 micro-batches x 2 forwards of 2 rows
    assert first.losses + resumed.losses == reference.losses and len(reference.losses) == 4
    final = dict(reference.drafter.named_parameters())
    for name, param in resumed.drafter.named_parameters():
        assert torch.equal(param, final[name]), name


def test_drafter_rows_given_on_resume_win_over_the_saved_ones(assets, tmp_path, monkeypatch, caplog):
    with monkeypatch.context() as patch:
        _out_of_memory_at({1}, patch)
        Trainer(settle(_config(assets, tmp_path / "run", save=True))).train()
    caplog.clear()
    forwards = _recording_group_weights(monkeypatch)
    resumed = Trainer(settle(_config(assets, tmp_path / "run", save=True, steps=2, drafter_rows=4, resume=True)))
    resumed.train()
    assert len(forwards) == 1
    assert (
        "--drafter-rows 4 given on resume: the drafter runs 4 rows per forward, not the 2 rows the saved run's "
        "first step settled on" in caplog.text
    )


def _sine(x):
    return torch.sin(x)


@pytest.mark.parametrize("layout", [{}, THREADED], ids=["local", "threaded"])
def test_the_failed_attempts_compiles_are_counted(assets, tmp_path, monkeypatch, layout):
    # A compiled region (eager backend) that each drafter forward calls at its rows: the failed
    # attempt compiles it for 4 rows, the retry for 2; the run's compile summary counts both.
    trainer = Trainer(settle(_config(assets, tmp_path / "run", **layout)))
    replicas = trainer.engine.replicas if layout else [trainer.engine.replica]
    regions = {r.name: CompiledRegion("probe", _sine, index, "eager") for index, r in enumerate(replicas)}
    for r in replicas:
        r.watch = StepWatch(r.name, [regions[r.name]])
    real = dflash.train.step._drafter_step
    failed: set[str] = set()

    def probing(*args):
        name = threading.current_thread().name
        replica = next(r for r in replicas if r.name == name or not layout)
        rows = args[3][0].shape[0]  # the input ids of this forward's rows
        regions[replica.name](torch.ones(rows))
        if replica.name not in failed:
            failed.add(replica.name)
            raise torch.OutOfMemoryError(OOM)
        return real(*args)

    monkeypatch.setattr(dflash.train.step, "_drafter_step", probing)
    trainer.train()
    assert failed == {r.name for r in replicas}
    summary = trainer.engine.compile_summary()
    assert summary == {
        r.name: dict(compiles=2, unexpected_recompiles=0, eager_fallbacks=0, graph_breaks=0) for r in replicas
    }


def test_a_replica_that_runs_out_is_retried_alone_while_its_sibling_trains_on(assets, tmp_path, monkeypatch, caplog):
    # drafter1's second forward of step 1 runs out; drafter0 finishes the step at 4 rows. The run
    # equals one where drafter1 starts at 2 rows and drafter0 stays at 4, bit for bit.
    flags = dict(grad_accum=2, steps=3, **THREADED)
    expected = record_losses(Trainer(settle(_config(assets, tmp_path / "expected", **flags))))
    expected.engine.rows[1].per_forward = 2
    expected.train()
    real = dflash.train.step._drafter_step
    calls: dict[str, int] = {}

    def failing(*args):
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1  # one thread per name: no lock needed
        if name.startswith("drafter1") and calls[name] == 2:
            raise torch.OutOfMemoryError(OOM)
        return real(*args)

    monkeypatch.setattr(dflash.train.step, "_drafter_step", failing)
    retried = record_losses(Trainer(settle(_config(assets, tmp_path / "retried", **flags))))
    retried.train()
    assert [r.getMessage().split(": ")[0] for r in caplog.records if "retrying" in r.getMessage()] == [
        "drafter1 (cpu:1) step 1"
    ]
    # drafter0: 2 forwards of 4 rows a step; drafter1: the failed 2, then 4 of 2 rows a step.
    assert calls == {"drafter0 (cpu:0)": 3 * 2, "drafter1 (cpu:1)": 2 + 3 * 4}
    assert [r.per_forward for r in retried.engine.rows] == [4, 2]
    assert retried.losses == expected.losses and len(expected.losses) == 3
    for (name, p), q in zip(expected.drafter.named_parameters(), retried.drafter.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("layout", [{}, THREADED], ids=["local", "threaded"])
def test_an_error_other_than_out_of_memory_in_the_first_step_is_raised_unchanged(assets, tmp_path, monkeypatch, layout):
    bug = RuntimeError("a bug in the drafter step")
    real = dflash.train.step._drafter_step
    calls = []

    def failing(*args):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # after a forward that put its gradients in the buffer
            raise bug
        return real(*args)

    monkeypatch.setattr(dflash.train.step, "_drafter_step", failing)
    trainer = Trainer(settle(_config(assets, tmp_path / "run", grad_accum=2, **layout)))
    try:
        with pytest.raises(RuntimeError) as raised:
            trainer.engine.run(1, lr=1e-2)
    finally:
        trainer.engine.close()
    assert raised.value is bug or raised.value.__cause__ is bug  # the threaded engine's PipelineError names it
    assert [r.per_forward for r in (trainer.engine.rows if layout else [trainer.engine.rows])] == [4] * (
        1 + bool(layout)
    )


def _cli(assets, out, *flags):
    inputs = ["--target", str(assets["target"]), "--data", str(assets["data"]), "--out", str(out)]
    tiny = ["--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48", "--max-anchors", "4"]
    return main(["train", *inputs, *tiny, "--batch-size", "4", "--no-progress", "--no-save", *flags])


@pytest.mark.parametrize("layout", [[], ["--target-devices", "cpu", "--drafter-devices", "cpu"]])
def test_an_out_of_memory_error_after_the_first_step_is_not_retried(assets, tmp_path, monkeypatch, caplog, layout):
    _out_of_memory_at({2}, monkeypatch)  # step 2's forward (one micro-batch of 4 rows a step)
    assert _cli(assets, tmp_path / "run", "--steps", "3", *layout) == 1
    assert "retrying" not in caplog.text
    assert (
        "out of GPU memory in step 2, in the drafter's forward/backward at 4 rows per forward (an allocation of "
        "2.37 GiB failed)" in caplog.text
    )
    assert "--drafter-rows 2: the drafter runs each micro-batch 2 rows at a time" in caplog.text


def test_a_drafter_that_runs_out_at_one_row_ends_with_the_message(assets, tmp_path, monkeypatch, caplog):
    _out_of_memory_at(set(range(1, 100)), monkeypatch)
    assert _cli(assets, tmp_path / "run", "--steps", "2") == 1
    assert "at 4 rows per forward (an allocation of 2.37 GiB failed); retrying" in caplog.text
    assert "at 2 rows per forward (an allocation of 2.37 GiB failed); retrying" in caplog.text
    assert "out of GPU memory in step 1, in the drafter's forward/backward at 1 row per forward" in caplog.text
    assert "--drafter-rows" not in caplog.text.split("out of GPU memory in step 1")[1]  # nothing fewer to offer
    assert "--batch-size 2 --grad-accum 2" in caplog.text


def test_drafter_rows_that_do_not_divide_the_batch_are_refused_before_anything_loads(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"drafter_rows 3 does not divide --batch-size 4.*pass one of \[1, 2, 4\]"):
        TrainConfig(batch_size=4, drafter_rows=3)
    with pytest.raises(ValueError, match=r"drafter_rows must be >= 0, got -1: .*or 0 for the whole micro-batch"):
        TrainConfig(batch_size=4, drafter_rows=-1)
    assert TrainConfig(batch_size=4, drafter_rows=0).drafter_rows == 0  # 0: the whole micro-batch
    out = tmp_path / "run"
    assert main(["train", "--batch-size", "4", "--drafter-rows", "3", "--out", str(out), "--no-progress"]) == 2
    assert "--drafter-rows 3 does not divide --batch-size 4" in caplog.text
    assert not out.exists()


def test_the_rows_tried_are_divisors_of_the_batch_each_at_most_half_the_last():
    assert row_counts(4, 4) == [4, 2, 1]
    assert row_counts(8, 2) == [2, 1]
    assert row_counts(9, 9) == [9, 3, 1]
    assert row_counts(10, 10) == [10, 5, 2, 1]
    assert row_counts(12, 12) == [12, 6, 3, 1]
    assert row_counts(1, 1) == [1]
    with pytest.raises(ValueError, match="1 row per forward has nothing fewer to try"):
        fewer_rows(4, 1)


def test_a_resume_may_change_the_rows_per_drafter_forward(assets, tmp_path):
    Trainer(settle(_config(assets, tmp_path / "run", save=True))).train()
    resumed = Trainer(settle(_config(assets, tmp_path / "run", save=True, steps=2, drafter_rows=2, resume=True)))
    assert resumed.step == 1
    resumed.train()


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: out of memory",  # torch's C10_CUDA_CHECK (cudaGetErrorString)
        "Triton Error [CUDA]: out of memory",  # Triton's launcher, gpuAssert (cuGetErrorString)
        "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n"
        "Last error:\nCuda failure 'out of memory'",  # NCCL's CUDACHECK, as torch reports its last error
    ],
)
def test_the_runtime_errors_of_a_failed_cuda_allocation_are_out_of_memory_errors(message):
    error = RuntimeError(message)
    assert out_of_memory_error(error) is error
    try:
        raise RuntimeError("the drafter step failed") from error
    except RuntimeError as wrapped:
        assert out_of_memory_error(wrapped) is error


def test_other_cuda_errors_are_not_out_of_memory_errors():
    assert out_of_memory_error(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")) is None
    assert (
        out_of_memory_error(
            RuntimeError("NCCL error: unhandled cuda error\nLast error:\nCuda failure 'invalid argument'")
        )
        is None
    )
