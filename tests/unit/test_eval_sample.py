"""``dflash eval`` reports on the whole held-out set by default; ``--num-prompts N`` is a random sample,
said so, with each figure's 95% interval; ``--temperature`` samples, for DFlash and DFlash2, each
figure with its interval, the same digits for the same ``--seed``; bad sampling flags are refused
first; prompts that are also the training data's are warned about; a run with no checkpoint yet is
called that. The CLI tests decode a few tokens on a tiny target."""

import json
import logging

import pytest
import torch
from tiny import CONVERSATIONS, make_target, save_random_drafter, write_chat_data, write_jsonl

from dflash.evaluation.decoding import Generation
from dflash.evaluation.report import bootstrap_intervals, summarize
from dflash.evaluation.sampling_settings import GREEDY


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory (random drafter) whose train_config.json names its training data."""
    root = tmp_path_factory.mktemp("eval-sample")
    target = make_target(root / "target", num_layers=5)
    save_random_drafter(target, root / "run")
    data = write_chat_data(root / "train.jsonl")
    (root / "run" / "train_config.json").write_text(json.dumps({"target": str(target), "data": str(data)}))
    return root / "run", data


EVAL = ["--device", "cpu", "--cpu-threads", "1", "--max-new-tokens", "4"]


def _eval(run_dir, data, *flags):
    from dflash.cli import main

    assert main(["eval", "--drafter", str(run_dir), "--data", str(data), *EVAL, *flags]) == 0


def test_the_whole_held_out_set_is_the_default(run, tmp_path, capsys):
    data = write_jsonl(tmp_path / "heldout.jsonl", [{"messages": c} for c in CONVERSATIONS[:3]])
    _eval(run[0], data)
    out = capsys.readouterr().out
    assert f"held-out prompts: all 3 usable prompts from {data}\n" in out and "95%" not in out
    _eval(run[0], data, "--json")
    report = json.loads(capsys.readouterr().out)
    assert report["num_prompts"] == 3 and report["intervals"] == {} and report["prompts"]["usable"] == 3


def test_a_sample_is_said_to_be_one_with_each_figures_interval(run, tmp_path, capsys):
    many = [
        [{"role": "user", "content": f"tell me a story {i}"}, {"role": "assistant", "content": "ok"}] for i in range(8)
    ]
    data = write_jsonl(tmp_path / "heldout.jsonl", [{"messages": c} for c in many])
    _eval(run[0], data, "--num-prompts", "3", "--seed", "1")
    out = capsys.readouterr().out
    assert f"held-out prompts: a random sample of 3 of its 8 usable prompts (--num-prompts, --seed) from {data}" in out
    assert "(a sample: each figure with its 95% interval" in out and out.count("] 95%") == 4
    _eval(run[0], data, "--num-prompts", "3", "--seed", "1", "--json")
    report = json.loads(capsys.readouterr().out)
    assert set(report["intervals"]) == {"tau_per_step", "tau_per_prompt", "speedup", "decode_speedup"}
    assert all(low <= high for low, high in report["intervals"].values())


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_sampled_eval_gives_each_figure_its_interval(run, tmp_path, capsys, arch):
    run_dir = tmp_path / "run"
    save_random_drafter(run[0].parent / "target", run_dir, arch=arch)
    data = write_jsonl(tmp_path / "heldout.jsonl", [{"messages": c} for c in CONVERSATIONS[:3]])
    sampled = ("--temperature", "1.0", "--top-p", "0.9", "--target", str(run[0].parent / "target"))
    _eval(run_dir, data, *sampled)
    out = capsys.readouterr().out
    assert "sampled at temperature 1, top-p 0.9 (--seed 0)" in out and "greedy check" not in out
    assert "(sampled: each figure with its 95% interval" in out and out.count("] 95%") == 4
    reports = []
    for _run in range(2):  # two runs with --seed 0: the same draws
        _eval(run_dir, data, *sampled, "--seed", "0", "--json")
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["decoding"] == "temperature 1, top-p 0.9" and reports[0]["mismatches"] is None
    assert set(reports[0]["intervals"]) == {"tau_per_step", "tau_per_prompt", "speedup", "decode_speedup"}
    same = ("tau_per_step", "tau_per_prompt", "histogram", "num_tokens")
    assert [reports[0][k] for k in same] == [reports[1][k] for k in same]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--top-p", "0.9"],
            "--top-p 0.9 with --temperature 0: greedy decoding takes the argmax and would ignore it; pass "
            "--temperature above 0 to sample, or leave --top-p unset",
        ),
        (["--top-p", "0.9", "--top-k", "20"], "--top-p 0.9 --top-k 20 with --temperature 0"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or a positive number, got -1.0"),
        (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--temperature", "1", "--top-k", "-2"], "--top-k must be 0 (every token) or a positive count, got -2"),
    ],
)
def test_bad_sampling_flags_are_refused_before_anything_loads(tmp_path, caplog, flags, named):
    from dflash.cli import main

    with caplog.at_level(logging.ERROR):
        assert main(["eval", "--drafter", str(tmp_path / "nowhere"), *flags]) == 2
    assert named in caplog.text and "nowhere" not in caplog.text


def test_bootstrap_intervals_resample_prompts():
    def prompt(lengths, seconds=1.0):
        tokens = list(range(sum(lengths) + 1))
        spec = Generation(tokens, lengths, seconds=seconds, prefill_seconds=0.1)
        return Generation(tokens, seconds=2 * seconds, prefill_seconds=0.1), spec

    alike = [prompt([4, 4])] * 10
    intervals = bootstrap_intervals(*map(list, zip(*alike)))
    assert intervals["tau_per_step"] == (4.0, 4.0) and intervals["speedup"] == (2.0, 2.0)
    mixed = [prompt([1, 1, 1]) for _ in range(10)] + [prompt([8, 8]) for _ in range(10)]
    plains, specs = map(list, zip(*mixed))
    low, high = bootstrap_intervals(plains, specs)["tau_per_step"]
    assert (
        1 < low < summarize(plains, specs, block_size=8, dtype=torch.float32, sampling=GREEDY).tau_per_step < high < 8
    )


def test_prompts_of_the_training_data_are_warned_about(run, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash.commands.evaluate"):
        _eval(run[0], run[1])
    assert (
        f"16 of the 16 held-out prompts are also prompts of the training data {run[1]}: on those, tau measures how "
        "well the drafter remembers replies it was trained on"
    ) in caplog.text


def test_a_run_with_no_checkpoint_yet_is_called_that(run, tmp_path, caplog):
    from dflash.cli import main

    young = tmp_path / "young"
    young.mkdir()
    (young / "train_config.json").write_text(json.dumps({"save_every": 100}))
    assert main(["eval", "--drafter", str(young), *EVAL]) == 2
    assert (
        f"{young}: no checkpoint saved yet (the run saves one every 100 steps (--save-every) and at its end); "
        "evaluate it once it has"
    ) in caplog.text
    assert main(["eval", "--drafter", str(young / "checkpoints"), *EVAL]) == 2  # not there yet either
    assert "does not exist" in caplog.text
