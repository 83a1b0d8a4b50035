"""dflash eval's inputs: prompts that do not fit the target's context are skipped (and a huge one
costs no more than a long one), the output says which file was evaluated and what was left out,
and bad counts are usage errors. The CLI tests decode a few tokens on a tiny target (~5 s)."""

import json
import logging
import time
from pathlib import Path

import pytest
from tiny import CONVERSATIONS, RecordingTokenizer, make_target, make_tokenizer, save_random_drafter, write_jsonl

from dflash.data.chats import DatasetError
from dflash.data.tokenize import char_budget
from dflash.evaluation.prompts import load_prompts


def _chat(user: str):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": "ok"}]


LONG = _chat("the cat sat on the mat " * 40)
NO_PROMPT = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _prompt_tokens(tokenizer, conversation) -> int:
    text = tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_prompt_fits_when_its_length_plus_the_new_tokens_is_within_the_context(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "heldout.jsonl", [{"messages": c} for c in (CONVERSATIONS[0], NO_PROMPT, LONG)])
    length = _prompt_tokens(tokenizer, LONG)
    held_out = load_prompts(tokenizer, data, num_prompts=5, context=length + 16, max_new_tokens=16)
    assert [p.shape[1] for p in held_out.prompts][-1] == length
    assert (len(held_out.prompts), held_out.too_long, held_out.without_prompt) == (2, 0, 1)
    held_out = load_prompts(tokenizer, data, num_prompts=5, context=length + 15, max_new_tokens=16)
    assert (len(held_out.prompts), held_out.too_long, held_out.without_prompt) == (1, 1, 1)
    assert held_out.max_prompt_tokens == length - 1
    assert held_out.to_dict() == {
        "source": str(data),
        "requested": 5,
        "used": 1,
        "usable": 1,
        "max_prompt_tokens": length - 1,
        "skipped_too_long": 1,
        "skipped_without_prompt": 1,
    }


def test_a_huge_prompt_is_skipped_without_rendering_or_tokenizing_it_whole(tokenizer, tmp_path):
    huge = _chat("word " * 2_000_000)  # the 2M-word prompt
    data = write_jsonl(tmp_path / "heldout.jsonl", [{"messages": c} for c in (huge, CONVERSATIONS[0])])
    recording = RecordingTokenizer(tokenizer)
    start = time.perf_counter()
    held_out = load_prompts(recording, data, num_prompts=5, context=2048, max_new_tokens=64)
    assert time.perf_counter() - start < 10
    assert (len(held_out.prompts), held_out.too_long) == (1, 1)
    assert max(recording.rendered) <= char_budget(2048 - 64) and max(recording.tokenized) <= char_budget(2048)


def test_no_usable_prompt_is_one_line_naming_why_and_the_fix(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "heldout.jsonl", [{"messages": c} for c in (LONG, NO_PROMPT, LONG)])
    with pytest.raises(DatasetError) as raised:
        load_prompts(tokenizer, data, num_prompts=5, context=64, max_new_tokens=32)
    assert str(raised.value) == (
        f"{data}: no usable prompt: 2 prompts are longer than 32 tokens (the target's max_position_embeddings "
        "64 minus --max-new-tokens 32) and 1 conversations have no user turn before an assistant turn (or one "
        "the chat template rejects); lower --max-new-tokens, or pass --data with shorter conversations and "
        "conversations that have a user turn before an assistant turn"
    )
    with pytest.raises(ValueError, match=r"--max-new-tokens 64 leaves no room .* context of 64 tokens.*below 64"):
        load_prompts(tokenizer, data, num_prompts=5, context=64, max_new_tokens=64)


@pytest.mark.parametrize("flag, value", [("--cpu-threads", "0"), ("--cpu-threads", "-2"), ("--num-prompts", "0")])
def test_counts_below_one_are_usage_errors(tmp_path, capsys, flag, value):
    from dflash.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["eval", "--drafter", str(tmp_path), "--device", "cpu", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: must be a finite number > 0, got {value}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory trained (so its train_config.json says) on the user's data, on a tiny target
    (context 512)."""
    root = tmp_path_factory.mktemp("evalrun")
    target = make_target(root / "target", num_layers=5)
    save_random_drafter(target, root / "run")
    config = {"target": str(target), "data": "/data/my-support-chats.jsonl"}
    (root / "run" / "train_config.json").write_text(json.dumps(config))
    return root / "run"


EVAL = ["--device", "cpu", "--cpu-threads", "1"]


def test_eval_says_it_evaluates_the_embedded_set_and_not_the_training_data(run, capsys, caplog):
    from dflash.cli import main

    assert main(["eval", "--drafter", str(run), *EVAL, "--num-prompts", "2", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "held-out prompts: a random sample of 2 of its 149 usable prompts (--num-prompts, --seed) from " in out
    assert "heldout.jsonl (the embedded default held-out set" in out
    assert "the drafter was trained on /data/my-support-chats.jsonl" in caplog.text
    assert "fewer than" not in out


def test_eval_reports_skipped_prompts_and_fewer_than_asked(run, tmp_path, capsys, caplog):
    from dflash.cli import main

    data = write_jsonl(
        tmp_path / "mine.jsonl",
        [{"messages": c} for c in (CONVERSATIONS[0], _chat("the cat sat on the mat " * 400), NO_PROMPT)],
    )
    argv = ["eval", "--drafter", str(run), "--data", str(data), *EVAL, "--num-prompts", "5", "--max-new-tokens", "8"]
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"held-out data: {data}" in caplog.text
    assert f"held-out prompts: all 1 usable prompts from {data}\n" in out
    assert "skipped conversations: 1 longer than 504 tokens (the target's max_position_embeddings 512 minus " in out
    assert "--max-new-tokens 8); 1 without a user turn before an assistant turn" in out
    assert "fewer than --num-prompts 5: the file has no more usable conversations" in out
    assert main([*argv, "--json"]) == 0
    prompts = json.loads(capsys.readouterr().out)["prompts"]
    assert prompts == {
        "source": str(data),
        "requested": 5,
        "used": 1,
        "usable": 1,
        "max_prompt_tokens": 504,
        "skipped_too_long": 1,
        "skipped_without_prompt": 1,
        "embedded_default": False,
    }
    assert main([*argv[:-1], "600"]) == 2  # --max-new-tokens 600 in a 512-token context
    assert "leaves no room for a prompt in the target's context of 512 tokens" in caplog.text


def test_eval_of_a_random_weight_target_needs_the_flag_and_says_which_weights_are_random(run, tmp_path, caplog):
    """A benchmark run trained with --random-target-weights can be evaluated the same way; without the
    flag such a target is refused, naming the flag."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash.cli import main

    target = Path(shutil.copytree(run.parent / "target", tmp_path / "target"))
    weights = load_file(target / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, target / "model.safetensors")
    argv = ["eval", "--drafter", str(run), "--target", str(target), *EVAL, "--num-prompts", "1"]
    argv += ["--max-new-tokens", "2"]
    assert main(argv) == 2
    assert "lack 1 of the model's weights (lm_head.weight)" in caplog.text
    assert "--random-target-weights of dflash train and dflash eval keeps them random" in caplog.text
    caplog.clear()
    assert main([*argv, "--random-target-weights"]) == 0
    assert "1 of its weights are not in its files and stay random (--random-target-weights)" in caplog.text
