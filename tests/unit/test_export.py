"""`dflash export RUN --out DIR`: a serving-ready drafter that transformers loads with
trust_remote_code strictly, in bf16, with the launch lines and the measured acceptance."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from tiny import make_target, train_config, write_chat_data

from dflash.cli import main
from dflash.run.settle import settle
from dflash.run.step_dirs import find_checkpoint
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run directory of a 3-step tiny run with sliding layers, evaluated once, its target, held-out data)."""
    root = tmp_path_factory.mktemp("export")
    target = make_target(root / "target", num_layers=5)
    heldout = write_chat_data(root / "heldout.jsonl", repeat=1)
    config = train_config(
        target=target,
        data=write_chat_data(root / "train.jsonl"),
        out=root / "run",
        steps=3,
        draft_layer_types="sliding,full",
        draft_sliding_window=8,
    )
    Trainer(settle(config)).train()
    args = ["eval", "--drafter", str(root / "run"), "--data", str(heldout), "--num-prompts", "2"]
    assert main([*args, "--max-new-tokens", "8", "--cpu-threads", "1"]) == 0
    return root / "run", target, heldout


def test_the_export_loads_with_trust_remote_code_strictly_in_bf16(run, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic_modules
    from transformers import AutoModel

    from dflash.evaluation.measure import load_drafter

    run_dir, target_dir, _ = run
    out = tmp_path / "tiny-dflash"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["dtype"] == "bfloat16" and "is_causal" not in raw and "auto_map" in raw  # the engines' default rule
    assert raw["layer_types"] == ["sliding_attention", "full_attention"] and raw["sliding_window"] == 8
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    model, info = AutoModel.from_pretrained(out, trust_remote_code=True, dtype="auto", output_loading_info=True)
    assert type(model).__module__.startswith("transformers_modules")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # The same drafter as the run's checkpoint, rounded to bf16.
    trained = load_drafter(run_dir, device=torch.device("cpu"), dtype=torch.float32)
    exported = load_drafter(out, device=torch.device("cpu"), dtype=torch.float32)  # verified by its manifest
    for name, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value.to(torch.bfloat16).float()), name
    context = torch.randn(1, 20, len(raw["dflash_config"]["target_layer_ids"]) * raw["hidden_size"])
    block = torch.randn(1, raw["block_size"], raw["hidden_size"])
    with torch.no_grad():
        served = model.float()(noise_embedding=block, target_hidden=context, position_ids=torch.arange(24)[None])
        torch.testing.assert_close(served, exported.block_hidden(context, block))


def test_the_readme_has_the_launch_lines_and_the_measured_acceptance(run, tmp_path):
    from dflash.run import acceptance_log

    run_dir, target_dir, heldout = run
    out = tmp_path / "my-dflash"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "float32"]) == 0
    readme = (out / "README.md").read_text()
    block = json.loads((out / "config.json").read_text())["block_size"]
    assert f'"num_speculative_tokens": {block - 1}' in readme and '"method": "dflash"' in readme
    assert f"vllm serve {target_dir.name}" in readme and "VLLM_USE_V2_MODEL_RUNNER=1" in readme  # mixed layer types
    assert "--speculative-algorithm DFLASH" in readme and f"--speculative-num-draft-tokens {block}" in readme
    measured = acceptance_log.most_complete_for(run_dir, find_checkpoint(run_dir).name)
    low, high = measured["intervals"]["tau_per_prompt"]  # a sample of 2 prompts
    assert f"tau {measured['tau_per_prompt']:.3f} [{low:.3f}, {high:.3f}] per prompt" in readme
    assert "a random sample of 2 held-out prompts (95% bootstrap intervals" in readme and str(heldout) in readme
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_an_unmeasured_checkpoint_says_how_to_measure_it(run, tmp_path):
    run_dir = run[0]
    step = find_checkpoint(run_dir)
    out = tmp_path / "dflash-unmeasured"
    (run_dir / "acceptance.json").rename(tmp_path / "kept.json")
    try:
        assert main(["export", str(step), "--out", str(out)]) == 0
    finally:
        (tmp_path / "kept.json").rename(run_dir / "acceptance.json")
    assert f"Not measured: run `dflash eval --drafter {run_dir}`" in (out / "README.md").read_text()


def test_bad_destinations_are_refused_before_anything_is_written(run, tmp_path, caplog):
    run_dir = run[0]
    assert main(["export", str(run_dir), "--out", str(tmp_path / "drafter")]) == 2
    assert "vLLM recognises a DFlash drafter by 'dflash' in its path" in caplog.text
    taken = tmp_path / "taken-dflash"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["export", str(run_dir), "--out", str(taken)]) == 2
    assert "already exists and is not empty" in caplog.text and (taken / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "drafter").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["taken-dflash"]
    for inside in (run_dir / "export-dflash", run_dir / "checkpoints" / "dflash"):
        assert main(["export", str(run_dir), "--out", str(inside)]) == 2
        assert f"--out {inside} is inside {run_dir.resolve()}" in caplog.text and not inside.exists()


def test_the_readme_quotes_the_most_complete_measurement_and_no_host_paths(run, tmp_path):
    """It quoted the newest measurement (a 20-prompt sample, no interval) over the whole held-out
    set's, wrote the training host's absolute paths into the vLLM and SGLang lines, and "1 layers"."""
    from dflash.export import serving_readme
    from dflash.run import acceptance_log

    run_dir = shutil.copytree(run[0], tmp_path / "run")
    step = find_checkpoint(run_dir).name
    complete = acceptance_log.most_complete_for(run_dir, step)
    smaller = {**complete, "num_prompts": 1, "num_tokens": 3, "tau_per_prompt": 9.999, "source": "a later sample"}
    acceptance_log.record(run_dir, smaller)
    out = tmp_path / "serve" / "tiny-dflash"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert f"tau {complete['tau_per_prompt']:.3f} [" in readme and "9.999" not in readme
    assert "the most complete of the 2 measurements kept for this checkpoint" in readme
    commands = [
        line for line in readme.splitlines() if "vllm serve" in line or "sglang" in line or "--speculative" in line
    ]
    assert len(commands) >= 4 and not [line for line in commands if "/" in line.replace("--", "")]
    assert "vllm serve target " in readme + " " and '"model": "tiny-dflash"' in readme

    from dflash.drafter.files import read_drafter_config

    config = read_drafter_config(find_checkpoint(run_dir))
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    one = serving_readme(config, out=out, target="TARGET", step_dir=find_checkpoint(run_dir), dtype="bfloat16")
    assert "- 1 layer: 1 x full_attention" in one and "1 layers" not in one


def test_the_readme_quotes_a_greedy_measurement_before_a_sampled_one_and_says_how_each_decoded(run, tmp_path):
    """A sampled measurement (intervals from its draws) on more prompts was quoted over the greedy one
    and called "a random sample" of the prompts."""
    from dflash.run import acceptance_log

    run_dir = shutil.copytree(run[0], tmp_path / "run")
    step = find_checkpoint(run_dir).name
    greedy = acceptance_log.most_complete_for(run_dir, step)
    sampled = {
        **greedy,
        "num_prompts": greedy["num_prompts"] + 5,
        "tau_per_prompt": 1.234,
        "temperature": 1.0,
        "decoding": "temperature 1",
        "intervals": {"tau_per_prompt": [1.1, 1.3]},
        "mismatches": None,
    }
    acceptance_log.record(run_dir, sampled)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "a-dflash")]) == 0
    readme = (tmp_path / "a-dflash" / "README.md").read_text()
    assert f"tau {greedy['tau_per_prompt']:.3f} [" in readme and "1.234" not in readme and ", greedy, on " in readme

    (run_dir / "acceptance.json").unlink()
    acceptance_log.record(run_dir, sampled)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "b-dflash")]) == 0
    readme = (tmp_path / "b-dflash" / "README.md").read_text()
    assert "tau 1.234 [1.100, 1.300] per prompt" in readme and "sampled at temperature 1, on " in readme
    assert f"on {sampled['num_prompts']} held-out prompts (95% bootstrap" in readme and "random sample" not in readme
