"""dflash.data.regenerate: a regeneration stopped and started again counts its share whole ("N of M done",
"N of this share's M replies are kept"), not against the conversations still left. In-process, tiny
2-layer target (a few seconds)."""

import functools
import logging
import re

import pytest
from tiny import CONVERSATIONS, make_target

import dflash.data.regenerate as regenerate
from dflash.data.regenerate import regenerated_corpus
from dflash.target_model.files import load_tokenizer
from dflash.target_model.model import load_target

SETTINGS = dict(seq_len=96, max_new_tokens=4)
CORPUS = CONVERSATIONS * 2


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("regen-counts") / "target", num_layers=2)


def _stop_at_generate_call(target, monkeypatch, stop_at: int) -> None:
    generate, calls = target.model.generate, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt  # what SIGINT, or SIGTERM during regeneration, raises
        return generate(*args, **kwargs)

    monkeypatch.setattr(target.model, "generate", counted)


def _corpus(target, target_dir, cache):
    return regenerated_corpus(
        [target],
        load_tokenizer(target_dir),
        CORPUS,
        cache,
        key={"k": 1},
        resume=False,
        rank=0,
        world_size=1,
        progress=False,
        **SETTINGS,
    )


def test_counts_of_a_stopped_and_continued_regeneration_are_of_the_whole_share(
    target_dir, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="dflash.data.regenerate")
    monkeypatch.setattr(
        regenerate, "regenerate_replies", functools.partial(regenerate.regenerate_replies, batch_size=2)
    )
    target = load_target(target_dir, num_capture_layers=1, device="cpu")
    cache = tmp_path / "regenerated.jsonl"
    with monkeypatch.context() as patch:
        _stop_at_generate_call(target, patch, stop_at=2)  # one batch of 2 done
        with pytest.raises(KeyboardInterrupt):
            _corpus(target, target_dir, cache)
    with monkeypatch.context() as patch:
        _stop_at_generate_call(target, patch, stop_at=2)  # one more batch of 2
        with pytest.raises(KeyboardInterrupt):
            _corpus(target, target_dir, cache)
    assert len(_corpus(target, target_dir, cache)) == len(CORPUS)
    share = len(CORPUS)
    assert re.findall(r"continuing regeneration from \S+: (\d+) of (\d+) done", caplog.text) == [
        ("2", str(share)),
        ("4", str(share)),
    ]
    assert re.findall(r"regeneration stopped: (\d+) of this share's (\d+) replies", caplog.text) == [
        ("2", str(share)),
        ("4", str(share)),
    ]
