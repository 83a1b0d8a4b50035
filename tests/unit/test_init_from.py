"""`dflash train --init-from DIR`: fine-tuning a drafter in the published (z-lab) layout keeps its
shape, RoPE and weights, measures held-out acceptance before step 1 and after the last, and is
refused before the target loads when the drafter does not fit the target."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import TINY_TRAINING, make_target, train_config, write_chat_data

from dflash.cli import main
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.evaluation.decoding import stop_token_ids
from dflash.evaluation.measure import evaluate, load_drafter
from dflash.evaluation.prompts import load_prompts
from dflash.evaluation.sampling_settings import GREEDY
from dflash.run import acceptance_log
from dflash.run.settle import settle
from dflash.run.step_dirs import find_checkpoint
from dflash.target_model.files import load_tokenizer
from dflash.target_model.model import load_target

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
ROPE_THETA = 5e5  # not the target's: the drafter's own RoPE must survive


def _published_drafter(target_dir, out, **config_changes):
    """A random drafter for ``target_dir`` as z-lab publishes one: config.json (RoPE in the
    transformers 4 form, no auto_map, no is_causal) + model.safetensors in bf16."""
    target = load_target(target_dir, num_capture_layers=2, device="cpu")
    config = create_drafter_config(
        target.config,
        3,
        block_size=TINY_TRAINING["block_size"],
        target_layer_ids=target.layer_ids,
        mask_token_id=load_tokenizer(target_dir).convert_tokens_to_ids("<|mask|>"),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=40,
        layer_types=LAYER_TYPES,
        sliding_window=8,
    )
    torch.manual_seed(5)
    drafter = AnchoredDrafter._from_config(config)
    raw = {k: v for k, v in config.to_dict().items() if k not in ("rope_parameters", "is_causal", "auto_map")}
    raw |= {"rope_theta": ROPE_THETA, "rope_scaling": None, **config_changes}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(raw))
    save_file({k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from")
    target = make_target(root / "target", num_layers=5)
    data = write_chat_data(root / "train.jsonl", repeat=4)
    heldout = write_chat_data(root / "heldout.jsonl", repeat=1)
    return {"target": target, "data": data, "heldout": heldout, "drafter": _published_drafter(target, root / "dflash")}


def _flags(assets, out, **extra):
    flags = {**TINY_TRAINING, "target": assets["target"], "data": assets["data"], "out": out, **extra}
    flags.update(eval_data=assets["heldout"], eval_prompts=3, eval_max_new_tokens=12, cpu_threads=1)
    args = ["train"]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        args += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    return args


def test_training_starts_from_the_drafter_and_measures_acceptance_before_and_after(assets, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_flags(assets, out, init_from=assets["drafter"])) == 0
    printed = capsys.readouterr().out
    assert "held-out tau" in printed and "before step 1" in printed and "after the last step" in printed
    before, after = acceptance_log.read(out)
    assert before["checkpoint"] is None and after["checkpoint"] == find_checkpoint(out).name
    assert before["num_prompts"] == after["num_prompts"] == 3 and before["data"] == str(assets["heldout"])
    # The starting point measured is the published drafter, as dflash eval measures it.
    drafter = load_drafter(assets["drafter"], device=torch.device("cpu"), dtype=torch.float32)
    target = load_target(assets["target"], layer_ids=drafter.config.target_layer_ids, device="cpu")
    tokenizer = load_tokenizer(assets["target"])
    prompts = load_prompts(tokenizer, assets["heldout"], num_prompts=3, context=512, max_new_tokens=12)
    report = evaluate(
        target,
        drafter,
        prompts.prompts,
        max_new_tokens=12,
        eos_ids=stop_token_ids(tokenizer, target.config),
        sampling=GREEDY,
        seed=0,
        progress=False,
        sample=False,
    )
    assert (before["tau_per_prompt"], before["tau_per_step"]) == (report.tau_per_prompt, report.tau_per_step)
    # The fine-tuned checkpoint keeps the drafter's shape, window, taps, mask token and RoPE.
    raw = json.loads((find_checkpoint(out) / "config.json").read_text())
    published = json.loads((assets["drafter"] / "config.json").read_text())
    for field in ("layer_types", "sliding_window", "block_size", "dflash_config", "num_attention_heads", "head_dim"):
        assert raw[field] == published[field], field
    assert raw["rope_theta"] == ROPE_THETA and raw["intermediate_size"] == 40
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["init_from"] == str(assets["drafter"]) and saved["draft_layer_types"] == ",".join(LAYER_TYPES)
    # Resuming it measures no new starting point and keeps the same shape.
    assert main(_flags(assets, out, resume=True, steps=TINY_TRAINING["steps"] + 1)) == 0
    assert [m["checkpoint"] for m in acceptance_log.read(out)][:2] == [None, after["checkpoint"]]
    assert len(acceptance_log.read(out)) == 3


def test_the_run_starts_from_the_drafter_s_weights(assets, tmp_path):
    from safetensors.torch import load_file

    from dflash.train.trainer import Trainer

    config = train_config(target=assets["target"], data=assets["data"], out=tmp_path, init_from=str(assets["drafter"]))
    trainer = Trainer(
        settle(dataclasses.replace(config, eval_data=str(assets["heldout"]), eval_prompts=1, eval_max_new_tokens=4))
    )
    published = load_file(str(assets["drafter"] / "model.safetensors"))
    state = trainer.drafter.state_dict()
    assert set(state) == set(published)
    for name, value in published.items():
        assert torch.equal(state[name], value.float()), name


def test_a_run_directory_starts_from_its_latest_checkpoint(assets, tmp_path):
    # As dflash eval and dflash export take a run; it was refused ("config.json: missing").
    from safetensors.torch import load_file

    from dflash.drafter.model import load_drafter_dir
    from dflash.run.drafter_shape import resolve_drafter_shape

    first = tmp_path / "first"
    assert main(_flags(assets, first, init_from=assets["drafter"])) == 0
    step_dir = find_checkpoint(first)
    config = train_config(target=assets["target"], data=assets["data"], out=tmp_path / "second", init_from=str(first))
    resolved = resolve_drafter_shape(config)
    assert resolved.init_from == str(step_dir)  # saved so: a resume starts from the same weights
    drafter = load_drafter_dir(resolved.init_from, dtype=torch.float32)
    trained = load_file(str(step_dir / "model.safetensors"))
    assert all(torch.equal(drafter.state_dict()[name], value.float()) for name, value in trained.items())


@pytest.mark.parametrize("is_causal", [None, False, True])
def test_the_fine_tuned_drafter_keeps_the_source_drafter_s_causality(assets, tmp_path, is_causal):
    """A published config without is_causal keeps the engines' rule (causal sliding layers, and no
    key written); one that says is_causal keeps it, written as every engine reads it."""
    from dflash.train.trainer import Trainer

    changes = {} if is_causal is None else {"is_causal": is_causal}
    source = _published_drafter(assets["target"], tmp_path / "source-dflash", **changes)
    config = train_config(
        target=assets["target"], data=assets["data"], out=tmp_path / "run", init_from=str(source), steps=1
    )
    trainer = Trainer(
        settle(dataclasses.replace(config, eval_data=str(assets["heldout"]), eval_prompts=1, eval_max_new_tokens=4))
    )
    assert trainer.drafter.config.is_causal is is_causal
    expected = [kind == "sliding_attention" if is_causal is None else is_causal for kind in LAYER_TYPES]
    assert [trainer.drafter.config.layer_is_causal(kind) for kind in LAYER_TYPES] == expected
    trainer.train()
    raw = json.loads((find_checkpoint(tmp_path / "run") / "config.json").read_text())
    if is_causal is None:
        assert "is_causal" not in raw and "causal" not in raw["dflash_config"]
    else:
        assert raw["is_causal"] is raw["dflash_config"]["causal"] is is_causal


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": 64}, "hidden_size 64 does not fit the target"),
        ({"vocab_size": 512}, "vocab_size 512 does not fit the target"),
        ({"num_target_layers": 36}, "num_target_layers 36 does not fit the target"),
    ],
)
def test_a_drafter_that_does_not_fit_the_target_is_refused_before_it_loads(
    assets, tmp_path, caplog, monkeypatch, change, named
):
    drafter = _published_drafter(assets["target"], tmp_path / "other-dflash", **change)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    assert main(_flags(assets, tmp_path / "run", init_from=drafter)) == 2
    assert named in caplog.text


def _cut_short(drafter):
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    return drafter


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_cut_short, "model.safetensors is truncated"),
        (lambda d: d, "intermediate_size in config.json gives 48"),  # a config that does not describe the weights
    ],
)
def test_drafter_weights_that_cannot_load_are_refused_before_the_target_loads(
    assets, tmp_path, caplog, monkeypatch, damage, named
):
    changes = {} if damage is _cut_short else {"intermediate_size": 48}
    drafter = damage(_published_drafter(assets["target"], tmp_path / "broken-dflash", **changes))

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    assert main(_flags(assets, tmp_path / "run", init_from=drafter)) == 2
    assert named in caplog.text and str(drafter) in caplog.text


def test_a_checkpoint_changed_since_its_save_is_refused_before_the_target_loads(assets, tmp_path, caplog, monkeypatch):
    """A same-size change passes the header's checks; the step directory's manifest catches it, as
    --resume, dflash eval and dflash export do."""
    run = tmp_path / "first"
    assert main(_flags(assets, run, init_from=assets["drafter"])) == 0
    weights = find_checkpoint(run) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # a weight's last byte: the header and the size stay as they were
    weights.write_bytes(bytes(data))

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dflash.train.targets.load_target", no_target)
    assert main(_flags(assets, tmp_path / "second", init_from=run)) == 2
    assert f"{weights}: its content does not match the sha256" in caplog.text


def test_a_flag_that_contradicts_the_drafter_is_named(assets, tmp_path, caplog):
    flags = _flags(assets, tmp_path / "run", init_from=assets["drafter"], draft_sliding_window=16)
    assert main(flags) == 2
    assert "--draft-sliding-window 16 disagrees with the --init-from drafter" in caplog.text
    assert main(["train", "--eval-every", "2", "--out", str(tmp_path / "x")]) == 2
    assert "--eval-every: held-out acceptance needs held-out conversations; pass --eval-data" in caplog.text
