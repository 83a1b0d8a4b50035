"""dflash.evaluate: speculative output == greedy output; acceptance is counted right, both ways."""

import json
from pathlib import Path

import pytest
import torch
from tiny import make_target, write_chat_data

from dflash.evaluate import Generation, evaluate, greedy_generate, load_prompts, speculative_generate, summarize
from dflash.model import DFlashDraftModel, create_drafter_config
from dflash.target import load_target

MAX_NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("eval")
    target_dir = make_target(root / "target", num_layers=5)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_target(target_dir, num_capture_layers=2, device="cpu")
    data = write_chat_data(root / "heldout.jsonl", repeat=1)
    prompts = load_prompts(tokenizer, data, num_prompts=3, context=512, max_new_tokens=MAX_NEW + 8).prompts
    return target, tokenizer, prompts


def _random_drafter(target, tokenizer, block_size=4, seed=0):
    torch.manual_seed(seed)
    config = create_drafter_config(
        target.config,
        1,
        block_size=block_size,
        target_layer_ids=target.layer_ids,
        mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"),
    )
    return DFlashDraftModel._from_config(config, attn_implementation="sdpa").eval()


class _ScriptedDrafter:
    """Proposes the target's greedy continuation for the first `correct` slots, then junk."""

    def __init__(self, real, reference, prompt_len, correct):
        self.config, self.reference, self.prompt_len, self.correct = real.config, reference, prompt_len, correct

    def draft_block(self, target_hidden, block_embeds, lm_head):
        start = target_hidden.shape[1] - self.prompt_len + 1  # index of the first drafted token
        n = self.config.block_size - 1
        truth = (self.reference + [0] * (start + n))[start : start + n]
        junk = [(t + 1) % self.config.vocab_size for t in truth]  # differs from the greedy token
        return torch.tensor([truth[: self.correct] + junk[self.correct :]])


def test_speculative_output_equals_greedy_output(setup):
    target, tokenizer, prompts = setup
    drafter = _random_drafter(target, tokenizer)
    for prompt in prompts:
        plain = greedy_generate(target, prompt, max_new_tokens=MAX_NEW, eos_ids=set())
        spec = speculative_generate(target, drafter, prompt, max_new_tokens=MAX_NEW, eos_ids=set())
        assert len(plain.tokens) == MAX_NEW
        assert spec.tokens == plain.tokens
        assert sum(spec.accept_lengths) + 1 == len(spec.tokens)  # the first token comes from the prefill


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_acceptance_length_counts_accepted_drafts_plus_the_bonus(setup, correct):
    target, tokenizer, prompts = setup
    prompt = prompts[0]
    reference = greedy_generate(target, prompt, max_new_tokens=MAX_NEW + 8, eos_ids=set()).tokens
    drafter = _ScriptedDrafter(_random_drafter(target, tokenizer), reference, prompt.shape[1], correct)
    spec = speculative_generate(target, drafter, prompt, max_new_tokens=MAX_NEW, eos_ids=set())
    assert spec.tokens == reference[:MAX_NEW]
    assert spec.accept_lengths[:-1] == [correct + 1] * (len(spec.accept_lengths) - 1)


def test_generation_stops_at_eos_like_greedy(setup):
    target, tokenizer, prompts = setup
    reference = greedy_generate(target, prompts[1], max_new_tokens=MAX_NEW, eos_ids=set()).tokens
    eos = {reference[5]}
    plain = greedy_generate(target, prompts[1], max_new_tokens=MAX_NEW, eos_ids=eos)
    spec = speculative_generate(
        target, _random_drafter(target, tokenizer), prompts[1], max_new_tokens=MAX_NEW, eos_ids=eos
    )
    assert spec.tokens == plain.tokens == reference[: reference.index(reference[5]) + 1]
    assert sum(spec.accept_lengths) + 1 == len(spec.tokens)  # nothing counted past EOS
    oracle = _ScriptedDrafter(_random_drafter(target, tokenizer), reference, prompts[1].shape[1], correct=3)
    spec = speculative_generate(target, oracle, prompts[1], max_new_tokens=MAX_NEW, eos_ids=eos)
    assert spec.tokens == plain.tokens and sum(spec.accept_lengths) + 1 == len(spec.tokens)


def test_last_step_is_cut_for_tau_per_step_and_kept_whole_for_z_lab(setup):
    target, tokenizer, prompts = setup
    prompt = prompts[0]
    reference = greedy_generate(target, prompt, max_new_tokens=MAX_NEW + 8, eos_ids=set()).tokens
    oracle = _ScriptedDrafter(_random_drafter(target, tokenizer), reference, prompt.shape[1], correct=3)
    # 1 prefill token + 2 full steps of 4 + a last step cut from 4 to 2 tokens by the budget.
    spec = speculative_generate(target, oracle, prompt, max_new_tokens=11, eos_ids=set())
    assert spec.tokens == reference[:11]
    assert spec.accept_lengths == [4, 4, 2]
    assert spec.full_accept_lengths == [4, 4, 4]
    assert 0 < spec.prefill_seconds < spec.seconds


def _generation(tokens, seconds, prefill, cut=(), full=()):
    return Generation(list(range(tokens)), list(cut), list(full), seconds=seconds, prefill_seconds=prefill)


def test_summarize_reports_both_conventions():
    plains = [_generation(10, 2.0, 0.2), _generation(4, 1.0, 0.2)]
    specs = [
        _generation(10, 1.0, 0.5, cut=[3, 2, 4], full=[3, 2, 6]),  # last step cut at EOS
        _generation(4, 0.5, 0.1, cut=[3], full=[3]),
    ]
    report = summarize(plains, specs, block_size=8)
    assert report.tau_per_step == pytest.approx((3 + 2 + 4 + 3) / 4)
    assert report.tau_per_prompt == pytest.approx(((3 + 2 + 6) / 3 + 3) / 2)
    assert report.histogram == {2: 1, 3: 2, 4: 1}
    assert report.target_ms_per_token == pytest.approx(1e3 * 3.0 / 14)
    assert report.speculative_ms_per_token == pytest.approx(1e3 * 1.5 / 14)
    assert report.speedup == pytest.approx(2.0)
    # z-lab: mean over prompts of decoding time per output token, prefill excluded.
    assert report.target_decode_ms_per_token == pytest.approx(1e3 * (1.8 / 10 + 0.8 / 4) / 2)
    assert report.speculative_decode_ms_per_token == pytest.approx(1e3 * (0.5 / 10 + 0.4 / 4) / 2)
    assert report.decode_speedup == pytest.approx((1.8 / 10 + 0.8 / 4) / (0.5 / 10 + 0.4 / 4))
    # A prompt that ended at the prefill token has no steps: left out of the per-prompt mean.
    report = summarize(plains + [_generation(1, 0.1, 0.1)], specs + [_generation(1, 0.1, 0.1)], block_size=8)
    assert report.tau_per_prompt == pytest.approx(((3 + 2 + 6) / 3 + 3) / 2)


def test_evaluate_reports_tau_histogram_and_speedup(setup, capsys):
    from dflash.commands.evaluate import _print_report

    target, tokenizer, prompts = setup
    report = evaluate(target, _random_drafter(target, tokenizer), prompts, max_new_tokens=8, eos_ids=set())
    assert report.num_prompts == 3 and report.num_tokens == 24
    assert sum(report.histogram.values()) > 0 and set(report.histogram) <= set(range(1, 5))
    steps = sum(report.histogram.values())
    assert report.tau_per_step == pytest.approx(sum(k * v for k, v in report.histogram.items()) / steps)
    assert 1 <= report.tau_per_prompt <= 4  # counts whole steps of a block of 4
    assert report.speedup == pytest.approx(report.target_ms_per_token / report.speculative_ms_per_token)
    assert report.decode_speedup == pytest.approx(
        report.target_decode_ms_per_token / report.speculative_decode_ms_per_token
    )
    keys = set(json.loads(json.dumps(report.to_dict())))
    assert {"tau_per_step", "tau_per_prompt", "histogram", "speedup", "decode_speedup"} <= keys
    _print_report(report)
    printed = capsys.readouterr().out
    assert f"{report.tau_per_step:.3f} per step" in printed and f"{report.tau_per_prompt:.3f} per prompt" in printed
    assert "with prefill" in printed and "without prefill" in printed


def test_drafter_tapping_other_layers_is_rejected(setup):
    target, tokenizer, prompts = setup
    drafter = _random_drafter(target, tokenizer)
    drafter.config.dflash_config["target_layer_ids"] = [0, 3]
    with pytest.raises(ValueError, match=r"drafter taps target layers \[0, 3\]"):
        speculative_generate(target, drafter, prompts[0], max_new_tokens=4, eos_ids=set())


def test_eval_command_reports_a_missing_drafter(tmp_path, caplog):
    from dflash.cli import main

    assert main(["eval", "--drafter", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "no checkpoint here" in caplog.text and "--out of dflash train" in caplog.text


def test_eval_defaults_to_the_target_the_run_was_trained_against(tmp_path):
    from dflash.commands.evaluate import _run_config, _trained_target

    def trained_target(drafter):
        return _trained_target(_run_config(drafter))

    step_dir = tmp_path / "run" / "checkpoints" / "step_00000003"
    step_dir.mkdir(parents=True)
    assert trained_target(step_dir) is None  # no train_config.json: the embedded default
    (tmp_path / "run" / "train_config.json").write_text(json.dumps({"target": "/models/my-target"}))
    for drafter in (tmp_path / "run", step_dir.parent, step_dir):
        assert trained_target(drafter) == Path("/models/my-target")
    (tmp_path / "run" / "train_config.json").write_text(json.dumps({"target": None}))
    assert trained_target(step_dir) is None
    export = tmp_path / "run" / "export"  # not inside checkpoints/: the run's file is not its
    export.mkdir()
    (tmp_path / "run" / "train_config.json").write_text(json.dumps({"target": "/models/my-target"}))
    assert trained_target(export) is None
    (tmp_path / "run" / "train_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="train_config.json: not valid JSON"):
        trained_target(step_dir)


def test_a_missing_drafter_is_named_before_the_held_out_data_is_read(tmp_path, caplog, monkeypatch):
    from dflash.cli import main

    def unread(*args, **kwargs):
        raise AssertionError("the held-out data was read")

    monkeypatch.setattr("dflash.evaluate.load_prompts", unread)
    assert main(["eval", "--drafter", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "nope: no checkpoint here (no such directory)" in caplog.text


def _z_lab_acceptance_lengths(reference: list[int], accepted: int, *, max_new_tokens: int, stop_ids: set[int]):
    """A stand-in of z-lab/dflash's ``dflash_generate`` bookkeeping (dflash/model.py, as
    ``benchmark.py`` runs it), for a target whose greedy continuation is ``reference`` and a drafter
    that gets ``accepted`` drafts of every block right: ``start`` indexes the last written token
    (the prefill token is written first), the loop runs while ``start < max_length``, writes
    ``accepted + 1`` tokens per step, records ``accepted + 1`` and stops after a step whose written
    tokens hold a stop token."""
    written, start, lengths = [reference[0]], 0, []
    while start < max_new_tokens:
        written = reference[: start + accepted + 2]
        start += accepted + 1
        lengths.append(accepted + 1)
        if stop_ids & set(written):
            break
    return lengths


@pytest.mark.parametrize(
    ("max_new_tokens", "stop_at"),
    [
        (9, None),  # 1 prefill token + 2 steps of 4: ends exactly at the budget, z-lab steps once more
        (11, None),  # the last step cut by the budget
        (1, None),  # the budget is the prefill token alone: z-lab still steps once
        (24, 0),  # the prefill token is a stop token: z-lab still steps once
        (24, 6),  # a stop token inside a step
        (24, 4),  # a stop token as a step's bonus token
    ],
)
def test_tau_per_prompt_counts_exactly_what_z_lab_s_loop_counts(setup, max_new_tokens, stop_at):
    target, tokenizer, prompts = setup
    prompt = prompts[0]
    reference = greedy_generate(target, prompt, max_new_tokens=MAX_NEW + 8, eos_ids=set()).tokens
    stop_ids = set() if stop_at is None else {reference[stop_at]}
    oracle = _ScriptedDrafter(_random_drafter(target, tokenizer), reference, prompt.shape[1], correct=3)
    spec = speculative_generate(target, oracle, prompt, max_new_tokens=max_new_tokens, eos_ids=stop_ids)
    plain = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_ids=stop_ids)
    assert spec.tokens == plain.tokens  # the extra step changes no output
    assert sum(spec.accept_lengths) + 1 == len(spec.tokens)
    z_lab = _z_lab_acceptance_lengths(reference, 3, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    assert spec.full_accept_lengths == z_lab
    if (max_new_tokens, stop_at) == (9, None):
        assert spec.accept_lengths == [4, 4] and spec.full_accept_lengths == [4, 4, 4]
