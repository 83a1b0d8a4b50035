"""--max-anchors past what a row can hold (a row of --seq-len tokens has at most seq_len - 1 anchors; the
rest are padding blocks the drafter still computes) is refused before anything loads, naming the flags,
instead of a multi-terabyte allocation traceback. A resumed run keeps what it was started with. Fast,
in-process (tiny target files, no model load)."""

import pytest
from tiny import make_target, train_config, write_chat_data

from dflash.run.preflight import validate_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchors")
    return {"target": make_target(root / "target", num_layers=5), "data": write_chat_data(root / "d.jsonl")}


def test_more_anchors_than_a_row_holds_is_refused_with_the_flags(inputs, tmp_path):
    config = train_config(**inputs, out=tmp_path / "run", seq_len=48, max_anchors=48)
    with pytest.raises(ValueError, match=r"--max-anchors 48 .* --seq-len 48 .*pass --max-anchors 47 or less"):
        validate_inputs(config)


def test_a_full_row_of_anchors_is_accepted(inputs, tmp_path):
    validate_inputs(train_config(**inputs, out=tmp_path / "run", seq_len=48, max_anchors=47))
