"""dflash.pipeline and dflash.devices on CPU "devices": threaded training equals the
single-device trainer on the same global batch, replicas stay bit-identical, exact resume,
thread failures reach the main thread, compiled-step fallbacks are detected, bad layouts."""

import functools
import logging
import threading

import pytest
import torch
from tiny import RecordingTrainer, make_target, write_chat_data

from dflash import pipeline
from dflash.checkpoint import CheckpointError
from dflash.cli import main
from dflash.config import TrainConfig
from dflash.devices import DeviceSpecError, parse_devices, parse_layout
from dflash.pipeline import Inbox, PipelineError, PipelineTrainer, seq_len_schedule
from dflash.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return {
        "target": make_target(root / "qwen3", num_layers=5),
        "data": write_chat_data(root / "train.jsonl", repeat=4),
    }


def _config(assets, out, **overrides):
    values = dict(
        target=str(assets["target"]),
        data=str(assets["data"]),
        out=str(out),
        block_size=4,
        gamma=2.0,
        num_target_layers=2,
        seq_len=48,
        batch_size=2,
        max_anchors=6,
        steps=4,
        warmup_steps=2,
        lr=1e-2,
        save_every=2,
        log_every=1,
        progress=False,
        seed=7,
        target_devices="cpu",
        drafter_devices="cpu:0-1",
    )
    values.update(overrides)
    return TrainConfig(**values)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


class _Recording(RecordingTrainer, PipelineTrainer):
    pass


def test_two_drafter_threads_equal_the_single_device_trainer_bitwise(assets, tmp_path):
    # Same global batch: 2 threads x 1 micro-batch == 1 device x grad_accum 2 (same batches, same
    # anchor stream). The two-term gradient sum g0 + g1 is the same float sum in both, and AdamW
    # sees identical inputs, so losses and weights match bit for bit (not just approximately).
    single = Trainer(_config(assets, tmp_path / "single", grad_accum=2, target_devices=None, drafter_devices=None))
    single_losses = []
    while single.step < 4:
        single.step += 1
        single_losses.append(single.train_step()["loss"])
    threaded = _Recording(_config(assets, tmp_path / "threaded"))
    threaded.train()
    assert threaded.losses == single_losses
    for replica in threaded.replicas:
        _assert_same_weights(replica.model, single.drafter)
    assert threaded.losses[-1] < threaded.losses[0]


def test_replicas_stay_identical_and_resume_is_exact(assets, tmp_path):
    config = dict(
        drafter_devices="cpu:0-2", target_devices="cpu:0-1", grad_accum=2, steps=6, save_every=3, batch_size=1
    )
    reference = _Recording(_config(assets, tmp_path / "full", **config))
    reference.train()
    first, second, third = (r.model for r in reference.replicas)
    _assert_same_weights(first, second)
    _assert_same_weights(first, third)

    crashed = _Recording(_config(assets, tmp_path / "split", **config))
    crashed.crash_after = 3
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    assert all(not w.is_alive() for w in crashed._threads)  # the threads were stopped
    resumed = _Recording(_config(assets, tmp_path / "split", resume=True, **config))
    assert resumed.step == 3
    resumed.train()
    assert crashed.losses + resumed.losses == reference.losses  # bitwise
    for replica in resumed.replicas:
        _assert_same_weights(replica.model, first)


def test_resume_with_a_different_drafter_layout_is_refused(assets, tmp_path):
    PipelineTrainer(_config(assets, tmp_path, steps=1)).train()
    with pytest.raises(CheckpointError, match="drafter_devices: 'cpu:0-1' -> 'cpu:0-2'"):
        PipelineTrainer(_config(assets, tmp_path, steps=2, drafter_devices="cpu:0-2", resume=True))
    # Target threads may change between runs: the math does not depend on them.
    resumed = PipelineTrainer(_config(assets, tmp_path, steps=2, target_devices="cpu:0-1", resume=True))
    assert resumed.step == 1


def test_a_failing_thread_stops_all_threads_and_is_reraised_with_its_name(assets, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = pipeline.produce_target_states

    def flaky(target, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("target exploded")
        return real(target, batch)

    monkeypatch.setattr(pipeline, "produce_target_states", flaky)
    trainer = PipelineTrainer(_config(assets, tmp_path))
    with pytest.raises(PipelineError, match=r"thread 'target cpu:0' failed: RuntimeError: target exploded") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(not w.is_alive() for w in trainer._threads)
    assert not [t for t in threading.enumerate() if t.name.startswith(("target ", "drafter "))]


def test_a_failing_drafter_thread_is_named(assets, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("drafter exploded")

    monkeypatch.setattr(pipeline, "drafter_step", broken)
    with pytest.raises(PipelineError, match=r"thread 'drafter cpu:\d' failed: ValueError: drafter exploded"):
        PipelineTrainer(_config(assets, tmp_path)).train()


def test_inbox_orders_out_of_order_puts_and_bounds_the_prefetch():
    control = pipeline._Control()
    inbox = Inbox(2, control)
    inbox.put(1, "b")
    inbox.put(0, "a")
    blocked = threading.Thread(target=inbox.put, args=(2, "c"))  # slot 2 >= next(0) + depth(2): waits
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and len(inbox) == 2
    assert inbox.get() == "a"  # frees room: slot 2 goes in
    blocked.join(2)
    assert not blocked.is_alive()
    assert [inbox.get(), inbox.get()] == ["b", "c"]
    control.fail("test", RuntimeError("boom"))
    with pytest.raises(PipelineError, match="'test' failed"):
        inbox.get()


def test_forced_recompiles_in_threads_run_compiled_and_fallbacks_are_reported(assets, tmp_path, monkeypatch, caplog):
    # aot_eager keeps the compiles CPU-cheap but still traces with make_fx (FX), the race window.
    monkeypatch.setattr(pipeline, "compiled_step_fn", functools.partial(pipeline.compiled_step_fn, backend="aot_eager"))
    config = dict(compile="on", vary_seq_len=2, steps=3, save_every=0, log_every=3)
    healthy = PipelineTrainer(_config(assets, tmp_path / "ok", **config))
    healthy.train()
    report = healthy.compile_report()
    assert report == {
        f"drafter cpu:{i}": {"compiles": 2, "unexpected_recompiles": 0, "eager_fallbacks": 0} for i in range(2)
    }

    # A recompile limit of 1 in the threads: the second length must be reported as an eager fallback.
    monkeypatch.setattr(pipeline, "raise_recompile_limit", lambda limit: pipeline._set_recompile_limit(1))
    starved = PipelineTrainer(_config(assets, tmp_path / "starved", **config))
    import torch._dynamo.config as dynamo_config

    original = getattr(dynamo_config, pipeline._recompile_limit_name())
    try:
        with caplog.at_level(logging.WARNING, logger="dflash.pipeline"):
            starved.train()
    finally:  # with the patches a thread's plain assignment is process-wide: restore it
        pipeline._set_recompile_limit(original)
    assert all(counts["eager_fallbacks"] >= 1 for counts in starved.compile_report().values())
    assert "ran EAGERLY" in caplog.text and "recompile_limit" in caplog.text


def test_seq_len_schedule():
    assert seq_len_schedule(48, 1) == [48]
    assert seq_len_schedule(48, 3) == [48, 40, 32]
    assert seq_len_schedule(4096, 4) == [4096, 3416, 2736, 2056]
    with pytest.raises(ValueError, match="too short"):
        seq_len_schedule(32, 4)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cuda:0", "CUDA is not available"),
        ("cpu:3-1", "descending range; write cpu:1-3"),
        ("gpu:0", "'gpu:0' is not a device"),
        ("cpu,,cpu:1", "empty device item"),
        ("cpu:0,cpu:0", "cpu:0 listed twice"),
        ("2", "'2' has no device type"),
    ],
)
def test_bad_device_specs_are_named(spec, message):
    with pytest.raises(DeviceSpecError, match=message):
        parse_devices(spec, flag="--drafter-devices")


def test_device_specs_parse():
    assert [s.name for s in parse_devices("cpu:0-2", flag="x")] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [s.name for s in parse_devices("cpu:0,2", flag="x")] == ["cpu:0", "cpu:2"]
    layout = parse_layout("cpu", "cpu:0-1")
    assert layout.device_type == "cpu" and len(layout.drafters) == 2


def test_missing_gpu_names_the_gpu_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceSpecError, match=r"cuda:5 does not exist; this host has 2 GPU\(s\) \(cuda:0..cuda:1\)"):
        parse_devices("cuda:0,5", flag="--drafter-devices")
    with pytest.raises(DeviceSpecError, match="mix cpu and cuda"):
        parse_layout("cuda:0", "cpu")


def test_cli_reports_bad_layouts(assets, tmp_path, caplog):
    base = ["train", "--target", str(assets["target"]), "--data", str(assets["data"]), "--out", str(tmp_path)]
    assert main(base + ["--target-devices", "cpu", "--drafter-devices", "cpu:1-0"]) == 2
    assert "descending range" in caplog.text
    assert main(base + ["--drafter-devices", "cpu"]) == 2
    assert "give both --target-devices and --drafter-devices" in caplog.text


def test_scaling_benchmark_smoke_on_cpu():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "drafter_scaling.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--phase",
            "scaling",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["solo"]["threads"] == 1 and result["multi"]["threads"] == 2
    assert result["multi"]["tokens_per_s_per_device"] > 0 and result["scaling"] > 0
    assert "scaling: W=2 per-device / solo" in done.stdout


def test_threads_compiling_without_the_patches_are_warned_about(monkeypatch, caplog):
    import dflash.patching.importhook as importhook
    from dflash.pipeline import _warn_if_unpatched

    with caplog.at_level(logging.WARNING):
        monkeypatch.setattr(importhook, "active_finder", lambda: object())
        _warn_if_unpatched(compiled=True, drafter_threads=3)
        monkeypatch.setattr(importhook, "active_finder", lambda: None)
        _warn_if_unpatched(compiled=False, drafter_threads=3)
        _warn_if_unpatched(compiled=True, drafter_threads=1)
        assert "patches are not active" not in caplog.text
        _warn_if_unpatched(compiled=True, drafter_threads=3)
    assert "patches are not active" in caplog.text and "3 drafter threads compiling" in caplog.text


@pytest.mark.parametrize(
    "drafter_wait,target_blocked,verdict",
    [
        (0.0, 0.01, "none"),
        (0.30, 0.01, "target side"),
        (0.01, 0.30, "drafter side"),
        (0.04, 0.0, "none"),
    ],
)
def test_bottleneck_is_named_only_when_a_side_really_waits(drafter_wait, target_blocked, verdict):
    from dflash.pipeline import _bottleneck

    assert _bottleneck({"drafter_wait": drafter_wait, "target_blocked": target_blocked}).startswith(verdict)
