"""dflash.evaluation: speculative output == greedy output; acceptance is counted right, both ways."""

import json
from pathlib import Path

import pytest
import torch
from tiny import ScriptedDrafter, make_target, write_chat_data

from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.evaluation.decoding import Generation, speculative_generate, target_generate
from dflash.evaluation.measure import evaluate
from dflash.evaluation.prompts import load_prompts
from dflash.evaluation.report import summarize
from dflash.evaluation.sampling import GREEDY_DECODER
from dflash.evaluation.sampling_settings import GREEDY
from dflash.target_model.model import load_target

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
    return AnchoredDrafter._from_config(config, attn_implementation="sdpa").eval()


def test_speculative_output_equals_greedy_output(setup):
    target, tokenizer, prompts = setup
    drafter = _random_drafter(target, tokenizer)
    for prompt in prompts:
        plain = target_generate(target, prompt, max_new_tokens=MAX_NEW, eos_ids=set(), decoder=GREEDY_DECODER)
        spec = speculative_generate(
            target, drafter, prompt, max_new_tokens=MAX_NEW, eos_ids=set(), decoder=GREEDY_DECODER
        )
        assert len(plain.tokens) == MAX_NEW
        assert spec.tokens == plain.tokens
        assert sum(spec.accept_lengths) + 1 == len(spec.tokens)  # the first token comes from the prefill


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_acceptance_length_counts_accepted_drafts_plus_the_bonus(setup, correct):
    target, tokenizer, prompts = setup
    prompt = prompts[0]
    reference = target_generate(
        target, prompt, max_new_tokens=MAX_NEW + 8, eos_ids=set(), decoder=GREEDY_DECODER
    ).tokens
    drafter = ScriptedDrafter(_random_drafter(target, tokenizer).config, reference, prompt.shape[1], correct=correct)
    spec = speculative_generate(target, drafter, prompt, max_new_tokens=MAX_NEW, eos_ids=set(), decoder=GREEDY_DECODER)
    assert spec.tokens == reference[:MAX_NEW]
    assert spec.accept_lengths[:-1] == [correct + 1] * (len(spec.accept_lengths) - 1)


def test_generation_stops_at_eos_like_greedy(setup):
    target, tokenizer, prompts = setup
    reference = target_generate(
        target, prompts[1], max_new_tokens=MAX_NEW, eos_ids=set(), decoder=GREEDY_DECODER
    ).tokens
    eos = {reference[5]}
    plain = target_generate(target, prompts[1], max_new_tokens=MAX_NEW, eos_ids=eos, decoder=GREEDY_DECODER)
    spec = speculative_generate(
        target,
        _random_drafter(target, tokenizer),
        prompts[1],
        max_new_tokens=MAX_NEW,
        eos_ids=eos,
        decoder=GREEDY_DECODER,
    )
    assert spec.tokens == plain.tokens == reference[: reference.index(reference[5]) + 1]
    assert sum(spec.accept_lengths) + 1 == len(spec.tokens)  # nothing counted past EOS
    oracle = ScriptedDrafter(_random_drafter(target, tokenizer).config, reference, prompts[1].shape[1], correct=3)
    spec = speculative_generate(target, oracle, prompts[1], max_new_tokens=MAX_NEW, eos_ids=eos, decoder=GREEDY_DECODER)
    assert spec.tokens == plain.tokens and sum(spec.accept_lengths) + 1 == len(spec.tokens)


def test_the_last_step_is_cut_at_the_budget(setup):
    target, tokenizer, prompts = setup
    prompt = prompts[0]
    reference = target_generate(
        target, prompt, max_new_tokens=MAX_NEW + 8, eos_ids=set(), decoder=GREEDY_DECODER
    ).tokens
    oracle = ScriptedDrafter(_random_drafter(target, tokenizer).config, reference, prompt.shape[1], correct=3)
    # 1 prefill token + 2 full steps of 4 + a last step cut from 4 to 2 tokens by the budget.
    spec = speculative_generate(target, oracle, prompt, max_new_tokens=11, eos_ids=set(), decoder=GREEDY_DECODER)
    assert spec.tokens == reference[:11]
    assert spec.accept_lengths == [4, 4, 2]
    assert 0 < spec.prefill_seconds < spec.seconds


def _generation(tokens, seconds, prefill, lengths=()):
    return Generation(list(range(tokens)), list(lengths), seconds=seconds, prefill_seconds=prefill)


def test_summarize_reports_both_conventions():
    plains = [_generation(10, 2.0, 0.2), _generation(4, 1.0, 0.2)]
    specs = [
        _generation(10, 1.0, 0.5, [3, 2, 4]),  # last step cut at EOS
        _generation(4, 0.5, 0.1, [3]),
    ]
    report = summarize(plains, specs, block_size=8, dtype=torch.float32, sampling=GREEDY)
    assert report.tau_per_step == pytest.approx((3 + 2 + 4 + 3) / 4)
    assert report.tau_per_prompt == pytest.approx(((3 + 2 + 4) / 3 + 3) / 2)
    assert report.histogram == {2: 1, 3: 2, 4: 1}
    assert report.target_ms_per_token == pytest.approx(1e3 * 3.0 / 14)
    assert report.speculative_ms_per_token == pytest.approx(1e3 * 1.5 / 14)
    assert report.speedup == pytest.approx(2.0)
    # z-lab: mean over prompts of decoding time per output token, prefill excluded.
    assert report.target_decode_ms_per_token == pytest.approx(1e3 * (1.8 / 10 + 0.8 / 4) / 2)
    assert report.speculative_decode_ms_per_token == pytest.approx(1e3 * (0.5 / 10 + 0.4 / 4) / 2)
    assert report.decode_speedup == pytest.approx((1.8 / 10 + 0.8 / 4) / (0.5 / 10 + 0.4 / 4))
    # A prompt that ended at the prefill token has no steps: left out of the per-prompt mean.
    report = summarize(
        plains + [_generation(1, 0.1, 0.1)],
        specs + [_generation(1, 0.1, 0.1)],
        block_size=8,
        dtype=torch.float32,
        sampling=GREEDY,
    )
    assert report.tau_per_prompt == pytest.approx(((3 + 2 + 4) / 3 + 3) / 2)


def test_evaluate_reports_tau_histogram_and_speedup(setup, capsys):
    from dflash.commands.evaluate import _print_report

    target, tokenizer, prompts = setup
    report = evaluate(
        target,
        _random_drafter(target, tokenizer),
        prompts,
        max_new_tokens=8,
        eos_ids=set(),
        sampling=GREEDY,
        seed=0,
        progress=False,
        sample=False,
    )
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
    _print_report(report, 0)
    printed = capsys.readouterr().out
    assert f"{report.tau_per_step:.3f} per step" in printed and f"{report.tau_per_prompt:.3f} per prompt" in printed
    assert "with prefill" in printed and "without prefill" in printed


def test_drafter_tapping_other_layers_is_rejected(setup):
    target, tokenizer, prompts = setup
    drafter = _random_drafter(target, tokenizer)
    drafter.config.dflash_config["target_layer_ids"] = [0, 3]
    with pytest.raises(ValueError, match=r"drafter taps target layers \[0, 3\]"):
        speculative_generate(target, drafter, prompts[0], max_new_tokens=4, eos_ids=set(), decoder=GREEDY_DECODER)


def test_eval_command_reports_a_missing_drafter(tmp_path, caplog):
    from dflash.cli import main

    assert main(["eval", "--drafter", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "does not exist" in caplog.text and "--out of dflash train" in caplog.text


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

    monkeypatch.setattr("dflash.evaluation.prompts.load_prompts", unread)
    assert main(["eval", "--drafter", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "nope: does not exist; pass a run directory" in caplog.text


def _z_lab_acceptance_lengths(
    reference: list[int], accepted: int, *, max_new_tokens: int, block_size: int, stop_ids: set[int]
) -> list[int]:
    """A stand-in of z-lab/dflash's ``dflash_generate`` bookkeeping at commit 10129599
    (``dflash/model.py``, as ``benchmark.py`` runs it), for a target whose greedy continuation is
    ``reference`` and a drafter that gets ``accepted`` drafts of every block right. Indices count
    from the prompt's end: ``start`` is the last written token (0: the prefill token) and
    ``max_length`` is ``max_new_tokens``. It steps while ``start + 1 < max_length`` and no stop token
    was written (none at all when the prefill token is one), verifies ``verify_size = min(block_size,
    max_length - start)`` tokens, records ``produced = min(accepted + 1, max_length - start - 1)``,
    cut after the first stop token among the tokens it wrote."""
    start, lengths = 0, []
    stopped = reference[0] in stop_ids
    while start + 1 < max_new_tokens and not stopped:
        verify_size = min(block_size, max_new_tokens - start)
        produced = min(min(accepted, verify_size - 1) + 1, max_new_tokens - start - 1)
        written = reference[start + 1 : start + produced + 1]
        stop = next((i for i, token in enumerate(written) if token in stop_ids), None)
        if stop is not None:
            produced, stopped = stop + 1, True
        start += produced
        lengths.append(produced)
    return lengths


@pytest.mark.parametrize(
    ("max_new_tokens", "stop_at"),
    [
        (9, None),  # 1 prefill token + 2 steps of 4: ends exactly at the budget, no step more
        (11, None),  # the last step cut by the budget
        (1, None),  # the budget is the prefill token alone: no step
        (24, 0),  # the prefill token is a stop token: no step
        (24, 6),  # a stop token inside a step
        (24, 4),  # a stop token as a step's bonus token
    ],
)
def test_tau_per_prompt_counts_exactly_what_z_lab_s_loop_counts(setup, max_new_tokens, stop_at):
    target, tokenizer, prompts = setup
    prompt = prompts[0]
    reference = target_generate(
        target, prompt, max_new_tokens=MAX_NEW + 8, eos_ids=set(), decoder=GREEDY_DECODER
    ).tokens
    stop_ids = set() if stop_at is None else {reference[stop_at]}
    drafter = _random_drafter(target, tokenizer)
    oracle = ScriptedDrafter(drafter.config, reference, prompt.shape[1], correct=3)
    spec = speculative_generate(
        target, oracle, prompt, max_new_tokens=max_new_tokens, eos_ids=stop_ids, decoder=GREEDY_DECODER
    )
    plain = target_generate(target, prompt, max_new_tokens=max_new_tokens, eos_ids=stop_ids, decoder=GREEDY_DECODER)
    assert spec.tokens == plain.tokens
    assert sum(spec.accept_lengths) + 1 == len(spec.tokens)
    z_lab = _z_lab_acceptance_lengths(
        reference, 3, max_new_tokens=max_new_tokens, block_size=drafter.config.block_size, stop_ids=stop_ids
    )
    assert spec.accept_lengths == z_lab
    report = summarize([plain], [spec], block_size=drafter.config.block_size, dtype=torch.float32, sampling=GREEDY)
    if z_lab:
        assert report.tau_per_prompt == pytest.approx(sum(z_lab) / len(z_lab))
    else:  # z-lab's mean of no steps is NaN; the prompt is left out
        assert report.tau_per_prompt != report.tau_per_prompt
    if (max_new_tokens, stop_at) == (11, None):
        assert z_lab == [4, 4, 2] and report.tau_per_prompt == pytest.approx(10 / 3)
