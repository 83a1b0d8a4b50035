"""Errors before slow work: every bad argument or input file is reported by
``validate_inputs`` (or the config) in well under a second, with a target whose loading would
take minutes; the clear messages of item 7 (tokenizer files, layer taps, CPU slots). That validation imports
neither transformers nor the trainer: tests/integration/test_preflight_imports.py."""

import json
import os
import shutil
import time

import pytest
import torch
from tiny import make_target, write_chat_data

from dflash.config import TrainConfig
from dflash.data.chats import DatasetError
from dflash.devices import DeviceSpecError, parse_devices
from dflash.drafter.files import CheckpointError
from dflash.run.preflight import validate_inputs
from dflash.target_model.files import TargetLoadError, load_tokenizer


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    return {"target": make_target(root / "target", num_layers=5), "data": write_chat_data(root / "chats.jsonl")}


@pytest.fixture
def slow_target(monkeypatch):
    """Loading the target (or importing what loads it) takes a minute, like a real one."""
    import transformers

    import dflash.target_model.model

    def slow(*args, **kwargs):
        time.sleep(60)

    for owner, name in (
        (transformers.AutoModelForCausalLM, "from_pretrained"),
        (transformers.AutoTokenizer, "from_pretrained"),
        (dflash.target_model.model, "load_target"),
    ):
        monkeypatch.setattr(owner, name, slow)


def _config(inputs, **overrides):
    values = dict(target=str(inputs["target"]), data=str(inputs["data"]), num_target_layers=2)
    return TrainConfig(**{**values, **overrides})


def _fast_error(build, error, match):
    """``build()`` raises ``error`` matching ``match`` within half a second."""
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        build()
    assert time.perf_counter() - start < 0.5


def _cases(inputs, tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(inputs["data"].read_text().splitlines()[0] + "\n\n{oops\n")
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(inputs["target"], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    a_file = tmp_path / "file"
    a_file.write_text("")
    cuda = "cuda:99" if torch.cuda.is_available() else "cuda:0"
    return [
        (dict(lr=float("nan")), ValueError, r"lr must be a finite number, got nan \(--lr\)"),
        (dict(lr=float("inf")), ValueError, r"lr must be a finite number, got inf"),
        (dict(grad_clip=float("nan")), ValueError, "grad_clip must be a finite number"),
        (dict(data=str(bad_json)), DatasetError, r"bad\.jsonl:3: malformed JSON"),
        (dict(data=str(tmp_path / "none.jsonl")), DatasetError, "no such data file; pass --data"),
        (dict(target=str(no_tokenizer)), TargetLoadError, f"no tokenizer_config.json in {no_tokenizer}"),
        (dict(target=str(tmp_path / "none")), TargetLoadError, "no such directory; pass --target"),
        (dict(num_target_layers=3), ValueError, "--num-target-layers 3: .* pass --num-target-layers 2, or .* 0,2,3"),
        (dict(target_layer_ids=[1, 7]), ValueError, r"--target-layer-ids 1,7: each id must be in \[0, 5\)"),
        (dict(mask_token_id=10**6), ValueError, "--mask-token-id 1000000 is not a token of the target"),
        (dict(seq_len=4096), ValueError, "--seq-len 4096 is longer than the target's max_position_embeddings 512"),
        (dict(out=str(run)), ValueError, "already holds a training run .*step_00000010.*--resume"),
        (dict(out=str(tmp_path / "empty"), resume=True), CheckpointError, "--out .*empty: does not exist; --resume"),
        (dict(out=str(a_file)), ValueError, f"--out {a_file} is a file"),
        (dict(device=cuda), ValueError, "--device cuda"),
        (dict(target_devices="cpu", drafter_devices="cpu,cpu"), DeviceSpecError, "write --drafter-devices cpu:0-1"),
        (dict(target_dtype="fp8"), ValueError, "--target-dtype fp8: FP8 matmuls need an NVIDIA GPU .* on cpu; or drop"),
        (dict(target_dtype="fp16"), ValueError, "target_dtype must be one of auto, fp8; got 'fp16'"),
    ]


def test_every_bad_input_is_reported_in_well_under_a_second(inputs, tmp_path, slow_target):
    for overrides, error, match in _cases(inputs, tmp_path):
        _fast_error(
            lambda overrides=overrides: validate_inputs(_config(inputs, **{"out": str(tmp_path / "out"), **overrides})),
            error,
            match,
        )
    assert not (tmp_path / "out").exists()  # nothing was written
    start = time.perf_counter()
    validate_inputs(_config(inputs, out=str(tmp_path / "out")))  # a good run passes, without loading anything
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("arch", "flags", "named"),
    [
        ("qwen3_5", ["--draft-sliding-window", "8"], "at least block_size=16 .*set by --block-size, --draft-sliding"),
        (
            "qwen3",
            ["--draft-heads", "6", "--draft-kv-heads", "4"],
            "not a multiple of .*set by --draft-heads, --draft-kv",
        ),
    ],
    ids=["window-under-the-block", "heads-over-kv-heads"],
)
def test_a_drafter_that_does_not_build_is_refused_before_the_target_loads(
    tmp_path, caplog, monkeypatch, arch, flags, named
):
    """A bad drafter shape used to pass validate_inputs and fail in the trainer's _build_drafter,
    after the target had loaded (55 GB for Qwen3.6-27B); its config is built first now."""
    from dflash.cli import main

    if arch == "qwen3_5" and not hasattr(__import__("transformers"), "Qwen3_5Config"):
        pytest.skip("Qwen3.5 needs transformers 5")
    target = make_target(tmp_path / "target", arch=arch, num_layers=8)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    run = ["train", "--target", str(target), "--data", str(write_chat_data(tmp_path / "c.jsonl")), "--steps", "1"]
    assert main([*run, "--out", str(tmp_path / "run"), "--num-target-layers", "2", "--no-progress", *flags]) == 2
    assert caplog.records and __import__("re").search(named, caplog.text), caplog.text


def test_load_tokenizer_names_missing_tokenizer_files(inputs, tmp_path):
    assert load_tokenizer(inputs["target"]).chat_template
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(TargetLoadError, match=f"no tokenizer_config.json in {bare} .*eos, pad.*save_pretrained"):
        load_tokenizer(bare)
    partial = tmp_path / "partial"
    shutil.copytree(inputs["target"], partial)
    (partial / "tokenizer.json").unlink()
    with pytest.raises(TargetLoadError, match=f"no tokenizer.json in {partial} \\(the target's vocabulary\\)"):
        load_tokenizer(partial)
    shutil.copy(inputs["target"] / "tokenizer.json", partial)
    (partial / "chat_template.jinja").unlink()
    config = json.loads((partial / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (partial / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TargetLoadError, match=f"no chat template in {partial} .*loss mask and prompts"):
        load_tokenizer(partial)


def test_a_four_layer_target_names_the_flags_and_values_that_work(tmp_path):
    from dflash.target_model.model import load_target

    target = make_target(tmp_path / "t4", num_layers=4)
    with pytest.raises(ValueError) as error:
        load_target(target, num_capture_layers=3)
    message = str(error.value)
    assert "--num-target-layers 3" in message and "pass --num-target-layers 1" in message
    assert "--target-layer-ids 0,1,2" in message and "num_captured" not in message
    assert load_target(target, layer_ids=[0, 1, 2]).layer_ids == [0, 1, 2]  # the suggestion works


def test_repeated_cpu_slots_suggest_numbered_ones(monkeypatch):
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 4)
    with pytest.raises(DeviceSpecError, match=r"cpu:0 listed twice.*write --drafter-devices cpu:0-2"):
        parse_devices("cpu,cpu,cpu", flag="--drafter-devices")
    assert [s.name for s in parse_devices("cpu:0-2", flag="--drafter-devices")] == ["cpu:0", "cpu:1", "cpu:2"]


def test_the_cli_reports_nan_before_loading_anything(inputs, tmp_path, slow_target, caplog):
    from dflash.cli import main

    start = time.perf_counter()
    argv = ["train", "--target", str(inputs["target"]), "--data", str(inputs["data"]), "--out", str(tmp_path)]
    assert main(argv + ["--lr", "nan"]) == 2
    assert time.perf_counter() - start < 0.5 and "lr must be a finite number" in caplog.text
    assert os.listdir(tmp_path) == []


def test_a_step_directory_as_out_is_named_before_any_work(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"is a checkpoint .*not a run directory.*probably {tmp_path / 'run'}"):
        validate_inputs(TrainConfig(out=str(step), resume=True))


def test_a_resume_of_an_out_without_a_run_names_the_flag_and_advice_that_works(tmp_path, monkeypatch):
    """`--resume` alone said `runs/dflash: does not exist; pass a run directory ... or a step_N directory`:
    no flag named, and a step_N directory as --out is what --resume refuses (the test above)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    cases = {
        "runs/dflash": r"--out runs/dflash \(the default\): does not exist",
        "empty": r"--out empty: holds no run \(no train_config.json, no checkpoints/\)",
        "other": r"--out other: holds no run \(no train_config.json, no checkpoints/\)",
    }
    for out, problem in cases.items():
        with pytest.raises(CheckpointError, match=f"^{problem}; --resume continues the run trained into --out: ") as e:
            validate_inputs(TrainConfig(out=out, resume=True))
        assert "pass that run's --out (the directory that holds its checkpoints/)" in str(e.value)
        assert "step_N" not in str(e.value)


def test_a_target_file_or_a_hub_id_is_named(inputs, tmp_path):
    weights = inputs["target"] / "model.safetensors"
    with pytest.raises(
        TargetLoadError, match=f"a file; pass --target with the model's directory \\({inputs['target']}"
    ):
        validate_inputs(TrainConfig(target=str(weights), data=str(inputs["data"]), out=str(tmp_path / "o")))
    with pytest.raises(ValueError, match="Hub ids are not downloaded.*huggingface-cli download Qwen/Qwen3-8B"):
        TrainConfig(target="Qwen/Qwen3-8B")
