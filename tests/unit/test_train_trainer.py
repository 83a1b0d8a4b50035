"""dflash.train.trainer and `dflash train`: exact resume, step-level loss normalisation, z-lab
checkpoints that transformers loads, Llama targets, compile monitoring, config errors."""

import json
import logging
import math
import os
import re
import time

import pytest
import torch
from tiny import CONVERSATIONS, make_target, record_losses, train_config, write_chat_data, write_jsonl

from dflash.cli import main
from dflash.config import TrainConfig
from dflash.data.chats import DatasetError
from dflash.drafter.files import CheckpointError
from dflash.run.settle import settle
from dflash.run.step_dirs import find_checkpoint, write_manifest
from dflash.signals import Stopped
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    return {
        "qwen3": make_target(root / "qwen3", num_layers=5),
        "llama": make_target(root / "llama", arch="llama", num_layers=5),
        "data": write_chat_data(root / "train.jsonl", repeat=4),
    }


def _config(assets, out, **overrides):
    return train_config(**{"target": assets["qwen3"], "data": assets["data"], "out": out, **overrides})


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_resume_continues_exactly(assets, tmp_path, arch):
    """Bit for bit, DFlash2's convolutions and selector (and their optimizer state) included."""
    reference = record_losses(Trainer(settle(_config(assets, tmp_path / "full", arch=arch))))
    reference.train()
    assert len(reference.losses) == 6
    if arch == "dflash2":  # trained: the selector has left its initialisation (successors 0)
        assert reference.drafter.candidate_selector.successor_codebook.abs().max() > 0

    first = record_losses(Trainer(settle(_config(assets, tmp_path / "split", arch=arch))), crash_after=3)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    assert find_checkpoint(tmp_path / "split").name == "step_00000003"
    resumed = record_losses(Trainer(settle(_config(assets, tmp_path / "split", resume=True, arch=arch))))
    assert resumed.step == 3
    resumed.train()
    assert first.losses + resumed.losses == reference.losses  # bitwise, not approximately
    final = dict(reference.drafter.named_parameters())
    for name, param in resumed.drafter.named_parameters():
        assert torch.equal(param, final[name]), name


def test_a_run_saved_with_every_layer_bidirectional_resumes_so_exactly(assets, tmp_path, monkeypatch):
    """Runs saved before the engines' causality rule was followed say is_causal false (every
    layer bidirectional, as they trained); a resume keeps that, not today's default rule."""
    import dflash.train.trainer as trainer_module

    sliding = dict(draft_layer_types="sliding,full", draft_sliding_window=8)
    rule = trainer_module.drafter_config
    with monkeypatch.context() as legacy:
        legacy.setattr(trainer_module, "drafter_config", lambda *a, **k: rule(*a, **{**k, "is_causal": False}))
        reference = record_losses(Trainer(settle(_config(assets, tmp_path / "full", **sliding))))
        reference.train()
        first = record_losses(Trainer(settle(_config(assets, tmp_path / "split", **sliding))), crash_after=3)
        with pytest.raises(KeyboardInterrupt):
            first.train()
    assert json.loads((find_checkpoint(tmp_path / "split") / "config.json").read_text())["is_causal"] is False
    resumed = record_losses(Trainer(settle(_config(assets, tmp_path / "split", resume=True, **sliding))))
    assert resumed.drafter.config.is_causal is False
    resumed.train()
    assert first.losses + resumed.losses == reference.losses
    # A new run of the same flags takes the default rule: its sliding layer is causal.
    assert Trainer(settle(_config(assets, tmp_path / "new", **sliding))).drafter.config.layer_is_causal(
        "sliding_attention"
    )


def test_resume_with_a_different_config_is_refused(assets, tmp_path):
    Trainer(settle(_config(assets, tmp_path / "run", steps=1))).train()
    with pytest.raises(CheckpointError, match=r"different config \(lr: 0\.01 -> 0\.02\).*same flags"):
        Trainer(settle(_config(assets, tmp_path / "run", steps=2, lr=2e-2, resume=True)))
    with pytest.raises(CheckpointError, match="empty: does not exist"):
        Trainer(settle(_config(assets, tmp_path / "empty", resume=True)))


def test_grad_accumulation_normalises_over_the_whole_optimizer_step(assets, tmp_path):
    # Two micro-batches of 2 must give the same update as one batch of 4 (same examples, same
    # anchors): the loss is divided by the weight sum of the step, not averaged per micro-batch.
    one = Trainer(settle(_config(assets, tmp_path / "a", batch_size=4, grad_accum=1, grad_clip=0.0, steps=1)))
    two = Trainer(settle(_config(assets, tmp_path / "b", batch_size=2, grad_accum=2, grad_clip=0.0, steps=1)))
    loss_one, loss_two = one.engine.run(1, lr=1e-2).loss, two.engine.run(1, lr=1e-2).loss
    assert loss_one == pytest.approx(loss_two, rel=1e-5)
    for (name, p1), p2 in zip(one.drafter.named_parameters(), two.drafter.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpoint_is_a_z_lab_drafter_that_transformers_loads(assets, tmp_path):
    from transformers import AutoConfig

    from dflash.drafter.model import AnchoredDrafter

    trainer = Trainer(settle(_config(assets, tmp_path, steps=2, save_every=0)))
    trainer.train()
    step_dir = find_checkpoint(tmp_path)
    raw = json.loads((step_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    assert raw["num_target_layers"] == 5
    assert raw["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 2]}
    config = AutoConfig.from_pretrained(step_dir)
    assert config.model_type == "qwen3" and config.dflash_config["target_layer_ids"] == [1, 2]
    loaded = AnchoredDrafter.from_pretrained(step_dir)
    from safetensors import safe_open

    with safe_open(str(step_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    for name, param in trainer.drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], param), name


def test_llama_target_trains_through_the_same_path(assets, tmp_path):
    trainer = record_losses(
        Trainer(settle(_config(assets, tmp_path, target=str(assets["llama"]), steps=8, save_every=0)))
    )
    trainer.train()
    assert type(trainer.engine.target.model).__name__ == "LlamaForCausalLM"
    assert trainer.engine.target.layer_ids == [1, 2]
    assert all(map(math.isfinite, trainer.losses)) and trainer.losses[-1] < trainer.losses[0]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="gamma: the paper gives no decay for block size 6 .*pass --gamma"):
        TrainConfig(block_size=6)
    with pytest.raises(ValueError, match="compile must be"):
        TrainConfig(compile="maybe")
    with pytest.raises(ValueError, match="steps/epochs: give --steps or --epochs"):
        TrainConfig(steps=None)
    # It was refused later with a fix that does not work ("pass --max-anchors 0 or less").
    with pytest.raises(ValueError, match=r"seq_len must be >= 2 \(an anchor and the token after it\), got 1"):
        TrainConfig(seq_len=1)


@pytest.mark.parametrize("block_size", [129, 200, 4096])
def test_a_block_longer_than_a_row_is_refused(block_size):
    """129 and 200 against --seq-len 128 trained silently; 4096 died in step 1 allocating 137 GB."""
    with pytest.raises(
        ValueError, match=f"block_size {block_size} is longer than --seq-len 128: .*pass --block-size 128"
    ):
        TrainConfig(block_size=block_size, gamma=block_size / 2)
    assert TrainConfig(block_size=128, gamma=64).block_size == 128


def test_the_cli_refuses_a_block_longer_than_a_row_before_anything_loads(tmp_path, caplog):
    from dflash.cli import main

    started = time.perf_counter()
    argv = ["train", "--block-size", "4096", "--gamma", "2048", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    assert time.perf_counter() - started < 5 and not (tmp_path / "run").exists()
    assert "--block-size 4096 is longer than --seq-len 128" in caplog.text


def test_cli_trains_and_reports_bad_input(assets, tmp_path, capsys, caplog):
    argv = [
        "train",
        "--target",
        str(assets["qwen3"]),
        "--data",
        str(assets["data"]),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "2",
        "--block-size",
        "4",
        "--gamma",
        "2",
        "--num-target-layers",
        "2",
        "--seq-len",
        "48",
        "--batch-size",
        "2",
        "--max-anchors",
        "4",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    assert main(argv[:4] + [str(bad)] + argv[5:] + ["--out", str(tmp_path / "b")]) == 2
    assert "bad.jsonl:1: message 0 has unknown role 'robot'" in caplog.text
    missing = "cuda:99" if torch.cuda.is_available() else "cuda:7"
    assert main(["train", "--device", missing, "--out", str(tmp_path / "c")]) == 2
    assert "--device cuda" in caplog.text


def test_a_target_rate_not_measured_is_not_printed_as_a_number(assets, tmp_path, caplog):
    """A target thread runs ahead of the drafter: in a 2-step run it forwards step 2's rows during step 1
    (the warm-up, not measured), and the summary printed step 2's rows over a 1e-9 s floor of busy time:
    `target forward 1024000000000 tok/s ... target share 0.0%`."""
    caplog.set_level(logging.INFO, logger="dflash.train")
    layout = dict(target_devices="cpu", drafter_devices="cpu")
    Trainer(settle(_config(assets, tmp_path / "run", steps=2, **layout))).train()
    summary = next(line for line in caplog.text.splitlines() if "steady state over 1 steps" in line)
    rate = re.search(r"target forward ([0-9.e+]+) tok/s", summary)
    if rate is None:  # no target forward finished in step 2
        assert "target forward not measured" in summary and "target share not measured" in summary, summary
    else:  # step 2 had forwards of its own: their rows over their busy time, well below 1e9 tok/s on a CPU
        assert float(rate.group(1)) < 1e9 and "target share 0.0%" not in summary, summary


def test_every_run_directory_keeps_its_log(assets, tmp_path, capsys, caplog):
    """There was no log file in --out: a run's history scrolled away with the console."""
    caplog.set_level(logging.INFO)  # the CLI's level (its basicConfig defers to pytest's handlers here)
    run = tmp_path / "run"
    argv = ["train", "--target", str(assets["qwen3"]), "--data", str(assets["data"]), "--out", str(run)]
    argv += ["--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48", "--batch-size", "2"]
    argv += ["--max-anchors", "4", "--no-progress", "--log-every", "1"]
    assert main([*argv, "--steps", "2", "--save-every", "2"]) == 0
    assert main(["train", "--resume", "--out", str(run), "--steps", "3", "--no-progress"]) == 0
    log = (run / "train.log").read_text()
    first, resumed = log.split("resumed from ")
    assert "drafter: DFlash, 1 layer(s)" in first and "step 2/2 loss" in first and "trained 2 steps: loss" in first
    assert "step 3/3 loss" in resumed and "trained 3 steps: loss" in resumed
    assert "step 3/3 loss" in caplog.text  # the console has the lines too


def test_the_log_file_gets_the_lines_logged_before_the_run_directory_was_known(tmp_path):
    from dflash.run.log_file import RunLog

    named = logging.getLogger("dflash.test_log_file")
    run_log = RunLog()
    try:
        named.warning("said while the flags settle")
        run_log.write_to(tmp_path)
        named.warning("said while training")
        run_log.note("trained 3 steps")
    finally:
        run_log.close()
    named.warning("said after the command")
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [
        "said while the flags settle",
        "said while training",
        "trained 3 steps",
    ]
    assert " WARNING dflash.test_log_file: " in lines[0]


def test_responses_regenerated_by_the_target_replace_the_corpus_replies(assets, tmp_path):
    from tiny import CONVERSATIONS
    from transformers import AutoTokenizer

    from dflash.data.chats import read_conversations
    from dflash.data.regenerate import prompt_that_fits
    from dflash.evaluation.decoding import target_generate
    from dflash.evaluation.sampling import GREEDY_DECODER

    trainer = Trainer(
        settle(_config(assets, tmp_path, responses="target", regenerate_max_new_tokens=6, steps=1, seq_len=96))
    )
    regenerated = read_conversations(tmp_path / "regenerated_train.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(assets["qwen3"])
    # One per conversation: its prompt (messages before the first assistant turn) + the target's reply.
    assert sum(prompt_that_fits(tokenizer, c, max_prompt_tokens=90) is not None for c in CONVERSATIONS) == 4
    assert len(regenerated) == 16 and [c[:-1] for c in regenerated[:4]] == [
        c[: 1 + (c[0]["role"] == "system")] for c in CONVERSATIONS
    ]
    history, reply = regenerated[0][:-1], regenerated[0][-1]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    greedy = target_generate(
        trainer.engine.target,
        torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]]),
        max_new_tokens=6,
        eos_ids={tokenizer.eos_token_id},
        decoder=GREEDY_DECODER,
    )
    assert reply == {"role": "assistant", "content": tokenizer.decode(greedy.tokens, skip_special_tokens=True)}


def test_mfu_flop_estimate_matches_a_flop_counter(assets, tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from dflash.train.flops import drafter_step_flops
    from dflash.train.step import drafter_step, produce_target_states

    trainer = Trainer(settle(_config(assets, tmp_path, max_anchors=2)))
    engine = trainer.engine
    engine.source.restart(first_step=1, last_step=1)
    job = engine.source.take()
    batch = produce_target_states(engine.target, job.batch, last_hidden=engine.settings.needs_last_hidden)
    r = engine.replica
    with FlopCounterMode(display=False) as counter:
        stats = drafter_step(
            r.step_fn,
            r.model,
            r.heads,
            batch,
            job.anchors,
            job.valid,
            settings=engine.settings,
            position_weight=r.position_weight,
        )
    blocks, pairs = float(stats[2]), float(stats[3])
    assert blocks == 4  # every block real, so no padding work is uncounted
    cfg = trainer.drafter.config
    draft_tokens = 4 * cfg.block_size
    estimate = drafter_step_flops(
        trainer.drafter, draft_tokens=draft_tokens, context_tokens=2 * 48, visible_pairs=pairs
    )
    # The counter has no formula for CPU SDPA, so compare the matmul part (attention term excluded).
    # The LM head's input gradient is formed in forward (fused loss), so nothing is recomputed.
    matmuls = estimate - drafter_step_flops(trainer.drafter, draft_tokens=0, context_tokens=0, visible_pairs=pairs)
    assert counter.get_total_flops() == pytest.approx(matmuls, rel=0.02)


def test_a_new_run_never_overwrites_an_existing_one(tmp_path):
    from dflash.run.preflight import refuse_existing_run

    refuse_existing_run(tmp_path, resume=False)  # empty --out: fine
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds a training run .*step_00000004.*--resume"):
        refuse_existing_run(tmp_path, resume=False)
    refuse_existing_run(tmp_path, resume=True)


def test_cli_resume_takes_unrepeated_flags_from_the_saved_run(assets, tmp_path, capsys):
    import shlex

    flags = ["--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48"]
    flags += ["--batch-size", "2", "--max-anchors", "4", "--lr", "0.02", "--seed", "3", "--no-progress"]
    inputs = ["--target", str(assets["qwen3"]), "--data", str(assets["data"])]
    out = tmp_path / "my run"  # a space: the printed commands must survive a copy into a shell
    assert main(["train", *inputs, *flags, "--out", str(out), "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert shlex.split(printed.split("evaluate with: ")[1].rstrip(")\n")) == ["dflash", "eval", "--drafter", str(out)]
    # Only --out, --resume and a longer --steps: every other flag (block size, lr, seed, inputs)
    # must come from train_config.json, or the resume would be refused as a different config.
    assert main(["train", "--resume", "--out", str(out), "--steps", "3", "--no-progress"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["block_size"], saved["lr"], saved["seed"], saved["steps"]) == (4, 0.02, 3, 3)
    assert find_checkpoint(out).name == "step_00000003"


def test_missing_inputs_fail_before_the_target_loads(assets, tmp_path, monkeypatch):
    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    with pytest.raises(CheckpointError, match="nothing: does not exist"):
        Trainer(settle(_config(assets, tmp_path / "nothing", resume=True)))
    with pytest.raises(ValueError, match="a directory, not a file; pass --data"):
        Trainer(settle(_config(assets, tmp_path / "run", data=str(tmp_path))))
    assert not (tmp_path / "nothing").exists() and not (tmp_path / "run").exists()


def test_a_damaged_checkpoint_is_refused_before_the_target_loads_and_hashed_once(assets, tmp_path, monkeypatch):
    """It was refused once the target's weights had loaded (the check ran when the trainer loaded it)."""
    import dflash.run.step_dirs

    Trainer(settle(_config(assets, tmp_path / "run", steps=1))).train()
    weights = find_checkpoint(tmp_path / "run") / "model.safetensors"
    hashed = []
    original = dflash.run.step_dirs.sha256_file
    monkeypatch.setattr(dflash.run.step_dirs, "sha256_file", lambda path: hashed.append(path.name) or original(path))
    Trainer(settle(_config(assets, tmp_path / "run", steps=2, resume=True)))
    assert sorted(hashed) == sorted(json.loads((weights.parent / "manifest.json").read_text()))  # each once

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the checkpoint was checked")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: its content does not match the sha256"):
        Trainer(settle(_config(assets, tmp_path / "run", steps=2, resume=True)))
    weights.write_bytes(data[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: 1000 bytes, but .*manifest\.json lists"):
        Trainer(settle(_config(assets, tmp_path / "run", steps=2, resume=True)))


@pytest.mark.parametrize(
    ("responses", "named"),
    [("data", "no conversation left to train on"), ("target", "none of its 2 conversations has a prompt")],
)
def test_data_without_a_usable_conversation_fails_before_the_target_loads(
    assets, tmp_path, monkeypatch, responses, named
):
    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was found unusable")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    unusable = [
        {"messages": [{"role": "system", "content": "be brief"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
    ]
    data = write_jsonl(tmp_path / "unusable.jsonl", unusable)
    with pytest.raises(DatasetError, match=named):
        Trainer(settle(_config(assets, tmp_path / "run", data=data, responses=responses)))


def test_too_little_data_for_one_batch_fails_before_the_target_loads(assets, tmp_path, monkeypatch):
    """It was refused once the target's weights had loaded."""

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was found too little")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    data = write_jsonl(tmp_path / "few.jsonl", [{"messages": m} for m in CONVERSATIONS[:3]])
    with pytest.raises(ValueError, match=r"3 examples pack into \d rows, which are fewer than one global batch"):
        Trainer(settle(_config(assets, tmp_path / "run", data=data, batch_size=4)))


def test_input_paths_are_saved_absolute_and_resume_from_another_directory(assets, tmp_path, monkeypatch):
    monkeypatch.chdir(assets["data"].parent)
    config = _config(assets, tmp_path / "run", steps=1, data=assets["data"].name)
    assert config.data == str(assets["data"])
    Trainer(settle(config)).train()
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["data"] == str(assets["data"]) and saved["target"] == str(assets["qwen3"])
    monkeypatch.chdir(tmp_path)
    assert Trainer(settle(TrainConfig.from_dict({**saved, "steps": 2, "resume": True}))).step == 1


def test_resume_compares_inputs_as_files_not_strings(assets, tmp_path, monkeypatch, caplog):
    from dflash.run.resume import check_resume_config

    # A run saved with a relative --data (before paths were saved absolute) resumes from its own directory...
    monkeypatch.chdir(assets["data"].parent)
    saved = {**_config(assets, tmp_path).to_dict(), "data": assets["data"].name}
    check_resume_config(saved, _config(assets, tmp_path), tmp_path)
    # ... and from elsewhere, where the saved path names nothing (as on another host), with a warning.
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        check_resume_config(saved, _config(assets, tmp_path), tmp_path)
    assert "which does not exist here" in caplog.text
    # Two existing, different files are a different config.
    other = tmp_path / "other.jsonl"
    other.write_text(assets["data"].read_text())
    with pytest.raises(CheckpointError, match="different config \\(data:"):
        check_resume_config(_config(assets, tmp_path).to_dict(), _config(assets, tmp_path, data=str(other)), tmp_path)


def test_resuming_with_another_length_warns_that_the_schedule_changes(assets, tmp_path, caplog):
    from dflash.run.resume import check_resume_config

    saved = _config(assets, tmp_path, steps=6).to_dict()
    with caplog.at_level(logging.WARNING):
        check_resume_config(saved, _config(assets, tmp_path, steps=6), tmp_path)
        assert "schedule" not in caplog.text
        check_resume_config(saved, _config(assets, tmp_path, steps=8), tmp_path)
    assert "steps 6 -> 8" in caplog.text and "learning-rate schedule is recomputed" in caplog.text


def test_cli_names_the_type_of_a_bad_number_and_says_how_to_resume_after_ctrl_c(
    assets, tmp_path, capsys, caplog, monkeypatch
):
    with pytest.raises(SystemExit):
        main(["train", "--steps", "abc"])
    assert "invalid int value: 'abc'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--target-layer-ids", "a,b"])
    assert "invalid comma-separated integer list value: 'a,b'" in capsys.readouterr().err  # not a function's name

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", interrupted)
    args = [
        "train",
        "--target",
        str(assets["qwen3"]),
        "--data",
        str(assets["data"]),
        "--out",
        str(tmp_path),
        "--block-size",
        "4",
        "--gamma",
        "2",
        "--num-target-layers",
        "2",
        "--seq-len",
        "48",
        "--no-progress",
    ]
    assert main(args) == 130
    assert "interrupted before the first checkpoint: nothing to --resume" in caplog.text


def test_ctrl_c_after_a_checkpoint_says_how_to_resume_once_per_job(tmp_path, caplog, monkeypatch):
    from dflash.commands.train import _resume_hint

    out = tmp_path / "my run"
    (out / "checkpoints" / "step_00000003").mkdir(parents=True)
    (out / "checkpoints" / "step_00000003" / "config.json").write_text("{}")
    monkeypatch.setenv("RANK", "1")
    _resume_hint(str(out), "interrupted")
    assert not caplog.text
    monkeypatch.setenv("RANK", "0")
    _resume_hint(str(out), "interrupted")
    assert f"continue with `dflash train --resume --out '{out}'`" in caplog.text


def test_packing_is_the_default_and_fills_rows(assets, tmp_path, monkeypatch):
    import dflash.train.local as local_module

    documents = []
    real = local_module.produce_target_states

    def spy(target, batch, **kwargs):
        documents.append(int(batch.document_ids.max()) + 1)  # documents in the fullest row
        return real(target, batch, **kwargs)

    monkeypatch.setattr(local_module, "produce_target_states", spy)
    packed = Trainer(settle(_config(assets, tmp_path / "packed", seq_len=96)))
    unpacked = Trainer(settle(_config(assets, tmp_path / "unpacked", seq_len=96, pack=False)))
    assert packed.config.pack and not unpacked.config.pack
    fills = {}
    for name, trainer in (("packed", packed), ("unpacked", unpacked)):
        documents.clear()
        stats = [trainer.engine.run(step, lr=1e-2) for step in (1, 2)]
        fills[name] = sum(s.tokens for s in stats) / sum(s.row_tokens for s in stats)
        assert all(map(math.isfinite, (s.loss for s in stats)))
        assert (max(documents) > 1) == (name == "packed")
    assert fills["packed"] > 1.5 * fills["unpacked"], fills


def test_no_save_trains_without_writing_a_checkpoint(assets, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(settle(_config(assets, tmp_path, steps=2, save_every=1, save=False)))
    assert "no checkpoint will be written" in caplog.text
    assert trainer.train()["loss"] > 0
    assert not (tmp_path / "checkpoints").exists()


def test_a_compile_scope_without_compiling_is_warned(assets, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        Trainer(settle(_config(assets, tmp_path / "default", compile="off")))
    assert "has no effect" not in caplog.text  # the default scope, not asked for
    with caplog.at_level(logging.WARNING):
        Trainer(settle(_config(assets, tmp_path / "asked", compile="off", compile_scope="step")))
    assert "--compile-scope step has no effect: the drafter step runs eagerly (--compile off on cpu)" in caplog.text


def test_a_second_training_into_the_same_out_is_refused_naming_the_first(assets, tmp_path, caplog):
    from dflash.run.lock import run_lock

    argv = ["train", "--target", str(assets["qwen3"]), "--data", str(assets["data"]), "--out", str(tmp_path)]
    argv += ["--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48", "--no-progress"]
    with run_lock(tmp_path):  # another training holds --out
        assert main(argv) == 2
    assert "train.lock" in caplog.text and str(os.getpid()) in caplog.text
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "train_config.json").exists()


def test_a_resume_of_a_run_still_running_before_its_first_checkpoint_names_it(tmp_path, caplog):
    """It said the run had stopped and to start it again, while that run held the lock."""
    from dflash.run.lock import run_lock

    run = tmp_path / "run"
    (run / "tokenized").mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    with run_lock(run):  # the run, still before its first save
        assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == 2
    assert f"{run} is in use by another training: pid {os.getpid()}" in caplog.text
    assert "no checkpoint yet" not in caplog.text


def test_a_second_training_into_the_same_out_is_refused_before_torch_is_imported(tmp_path):
    """It was refused once the trainer's imports (torch, transformers: 15.9 s) were done."""
    import subprocess
    import sys

    from dflash.run.lock import run_lock

    code = (
        "import sys; from dflash.cli import main; "
        f"code = main(['train', '--out', {str(tmp_path)!r}, '--no-progress']); "
        "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    with run_lock(tmp_path):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split("\n")[-2] == "2 []", proc.stdout + proc.stderr
    assert f"{tmp_path} is in use by another training: pid {os.getpid()}" in proc.stderr


def test_metrics_log_of_a_resumed_run_continues_from_its_checkpoint(assets, tmp_path):
    crashed = record_losses(Trainer(settle(_config(assets, tmp_path / "run", save_every=2))), crash_after=3)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()  # steps 1-3 logged, the checkpoint holds step 2
    Trainer(settle(_config(assets, tmp_path / "run", save_every=2, resume=True))).train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    # A new run into a directory left without a checkpoint starts a new log.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step"')
    Trainer(settle(_config(assets, tmp_path / "other", steps=1))).train()
    assert [json.loads(line)["step"] for line in (tmp_path / "other" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_warns_when_the_data_file_changed(assets, tmp_path, caplog):
    data = tmp_path / "train.jsonl"
    data.write_text(assets["data"].read_text())
    Trainer(settle(_config(assets, tmp_path / "run", data=str(data), steps=2))).train()
    with caplog.at_level(logging.WARNING):
        Trainer(settle(_config(assets, tmp_path / "run", data=str(data), steps=3, resume=True)))
        assert "data file changed" not in caplog.text
        data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
        Trainer(settle(_config(assets, tmp_path / "run", data=str(data), steps=3, resume=True)))
    assert "the data file changed since" in caplog.text


def test_no_save_says_nothing_was_saved(assets, tmp_path, capsys):
    argv = ["train", "--target", str(assets["qwen3"]), "--data", str(assets["data"]), "--out", str(tmp_path)]
    argv += ["--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48", "--steps", "1"]
    assert main([*argv, "--no-progress", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "nothing saved (--no-save)" in out and "drafter saved" not in out


class _Stops:
    """A stand-in Trainer whose construction or training raises ``error``."""

    def __init__(self, error):
        self.error = error

    def __call__(self, config):
        if isinstance(self.error, Stopped) and self.error.step is None:
            raise self.error  # during construction: regeneration runs there
        return self

    def train(self):
        raise self.error


def test_a_stopped_regeneration_exits_with_its_signal_and_no_resume_advice(tmp_path, caplog, monkeypatch):
    import signal

    monkeypatch.setattr("dflash.train.trainer.Trainer", _Stops(Stopped(signal.SIGTERM, "regeneration")))
    assert main(["train", "--out", str(tmp_path / "run"), "--no-progress"]) == 128 + signal.SIGTERM
    assert "nothing to --resume" not in caplog.text  # the regeneration said what it kept


def test_a_stop_under_no_save_says_nothing_was_saved(tmp_path, caplog, monkeypatch):
    import signal

    monkeypatch.setattr("dflash.train.trainer.Trainer", _Stops(Stopped(signal.SIGTERM, step=5)))
    assert main(["train", "--out", str(tmp_path / "run"), "--no-save", "--no-progress"]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step 5; nothing was saved (--no-save)" in caplog.text
    assert "checkpoint" not in caplog.text


def test_resume_of_a_run_stopped_while_regenerating_says_to_start_it_again(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "regenerated_train.jsonl.shard0-of-1.partial").write_text('{"key": {}}\n')
    assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == 2
    assert "no checkpoint yet, only the replies regenerated before the run stopped" in caplog.text
    assert "start the same run again without --resume" in caplog.text


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_to_start_it_again(tmp_path, caplog):
    """It said "no checkpoint here ... pass a run directory" about the run directory it was given."""
    run = tmp_path / "run"
    (run / "tokenized").mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    (run / "checkpoints" / "step_00000100.tmp").mkdir(parents=True)  # killed during its first save
    assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == 2
    assert f"{run} has no checkpoint yet: the run stopped before its first save" in caplog.text
    assert "start the same run again without --resume (it reuses what it kept: checkpoints, tokenized" in caplog.text


def test_resume_with_flags_that_change_the_math_is_refused_before_the_target_loads(
    assets, tmp_path, caplog, monkeypatch
):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    (run / "train_config.json").write_text(json.dumps(_config(assets, run, lr=3e-3).to_dict()))

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    assert main(["train", "--resume", "--out", str(run), "--lr", "1e-3", "--no-progress"]) == 2
    assert "different config (lr: 0.003 -> 0.001)" in caplog.text


def test_resume_with_another_block_size_is_refused_as_a_different_config_not_for_its_gamma(assets, tmp_path, caplog):
    """It asked for a --gamma (block size 6 has no paper gamma); given one, it refused the block size."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    (run / "train_config.json").write_text(json.dumps(_config(assets, run, block_size=8, gamma=None).to_dict()))
    assert main(["train", "--resume", "--out", str(run), "--block-size", "6", "--no-progress"]) == 2
    assert "different config (block_size: 8 -> 6)" in caplog.text
    assert "gamma" not in caplog.text


def test_config_errors_name_flags_not_fields(tmp_path, caplog):
    assert main(["train", "--keep-last", "0", "--out", str(tmp_path / "a")]) == 2
    assert "--keep-last must be >= 1, got 0" in caplog.text
    assert main(["train", "--drafter-devices", "cpu", "--out", str(tmp_path / "b")]) == 2
    assert "--target-devices/--drafter-devices: give both" in caplog.text


def test_resuming_a_finished_run_says_so_before_anything_loads(assets, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / "config.json").write_text("{}")
    write_manifest(run / "checkpoints" / "step_00000003", ["config.json"])  # its files are verified first
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    (run / "train_config.json").write_text(json.dumps(_config(assets, run, steps=3).to_dict()))
    monkeypatch.setattr("dflash.train.trainer.Trainer", _Stops(AssertionError("the trainer was built")))
    assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == 0
    assert f"nothing to train: {run} is already at step 3 of 3" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000003"]  # nothing written


@pytest.mark.parametrize("threaded", [False, True])
def test_out_of_memory_ends_with_the_flags_that_reduce_memory_not_a_traceback(
    assets, tmp_path, monkeypatch, capsys, caplog, threaded
):
    import dflash.train.step

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.37 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(dflash.train.step, "_drafter_step", out_of_memory)
    inputs = ["--target", str(assets["qwen3"]), "--data", str(assets["data"]), "--out", str(tmp_path / "run")]
    flags = ["--steps", "2", "--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48"]
    flags += ["--batch-size", "4", "--max-anchors", "4", "--no-progress"]
    if threaded:
        flags += ["--target-devices", "cpu", "--drafter-devices", "cpu"]
    assert main(["train", *inputs, *flags]) == 1
    err = capsys.readouterr().err + caplog.text
    assert "Traceback" not in err
    # Retried at 2 rows per drafter forward, then at 1 (dflash.train.drafter_rows), then the message.
    assert caplog.text.count("retrying the step on the same micro-batches") == 2
    assert (
        "out of GPU memory in step 1, in the drafter's forward/backward at 1 row per forward (an allocation of "
        "2.37 GiB failed)" in caplog.text
    )
    assert "--batch-size 2 --grad-accum 2: half the rows per micro-batch" in caplog.text
    assert "--max-anchors 2" in caplog.text and "--target-dtype fp8" in caplog.text


def test_an_error_raised_while_an_out_of_memory_error_was_handled_keeps_its_traceback(assets, tmp_path, monkeypatch):
    import dflash.train.step

    def broken_handler(*args, **kwargs):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            raise KeyError("a bug in the handler")  # noqa: B904 (the chain as a buggy handler leaves it)

    monkeypatch.setattr(dflash.train.step, "_drafter_step", broken_handler)
    inputs = ["--target", str(assets["qwen3"]), "--data", str(assets["data"]), "--out", str(tmp_path / "run")]
    flags = ["--steps", "2", "--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48"]
    with pytest.raises(KeyError, match="a bug in the handler"):
        main(["train", *inputs, *flags, "--batch-size", "2", "--max-anchors", "4", "--no-progress"])


def test_the_progress_bar_shows_the_loss_of_the_step_it_counts(assets, tmp_path, monkeypatch, capfd):
    """It drew step n with step n-1's loss (the postfix was set after the update that drew it)."""
    import re

    import tqdm

    class EveryStep(tqdm.tqdm):  # draws on every update, as a step of seconds does
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "mininterval": 0, "miniters": 1})

    monkeypatch.setattr(tqdm, "tqdm", EveryStep)
    trainer = record_losses(Trainer(settle(_config(assets, tmp_path, steps=4, log_every=100, progress=True))))
    trainer.train()
    frames = re.findall(r"train:[^\r\n]*?\b(\d)/4 \[[^\]]*loss=([\d.]+)", capfd.readouterr().err)
    shown = {int(step): float(loss) for step, loss in frames}
    assert set(shown) == {1, 2, 3, 4}
    assert shown == {step: round(loss, 3) for step, loss in enumerate(trainer.losses, start=1)}
