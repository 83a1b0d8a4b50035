"""--drafter-rows: a micro-batch's rows through the drafter in groups give the whole micro-batch's
step, normalised over the whole step."""

import pytest
import torch
from tiny import make_target, train_config, write_chat_data

import dflash.train.step
from dflash.cli import main
from dflash.config import TrainConfig
from dflash.run.settle import settle
from dflash.train.step import StatsLayout
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    return {"target": make_target(root / "qwen3", num_layers=5), "data": write_chat_data(root / "train.jsonl")}


def _config(assets, out, **overrides):
    # Packed rows (the default) of 4 per micro-batch: the rows hold different numbers of documents
    # and supervised slots, so each group of 2 has a normaliser of its own.
    values = dict(batch_size=4, max_anchors=4, grad_clip=0.0, steps=1, save=False)
    return train_config(target=assets["target"], data=assets["data"], out=out, **{**values, **overrides})


def _recording_group_weights(monkeypatch) -> list[float]:
    """The normaliser (position-weight sum) of each drafter forward from now on."""
    weights = []
    real = dflash.train.step._drafter_step

    def recording(*args):
        stats = real(*args)
        weights.append(stats[StatsLayout.WEIGHT].item())
        return stats

    monkeypatch.setattr(dflash.train.step, "_drafter_step", recording)
    return weights


@pytest.mark.parametrize(
    "flags",
    [
        dict(arch="dflash"),
        dict(arch="dflash", dpace=True, soft_label_weight=0.3, loss_chunk_blocks=1),
        dict(arch="dflash2"),
        dict(arch="dflash2", selector_target="soft", selector_missing_gold="exclude"),
    ],
    ids=["dflash", "dflash-dpace-soft", "dflash2", "dflash2-soft-selector"],
)
def test_groups_of_rows_give_the_whole_micro_batch_step(assets, tmp_path, monkeypatch, flags):
    whole = Trainer(settle(_config(assets, tmp_path / "whole", **flags)))
    split = Trainer(settle(_config(assets, tmp_path / "split", drafter_rows=2, **flags)))
    a = whole.engine.run(1, lr=1e-2)
    weights = _recording_group_weights(monkeypatch)
    b = split.engine.run(1, lr=1e-2)
    # Two groups with normalisers of their own: a split that divided by each would differ.
    assert len(weights) == 2 and abs(weights[0] - weights[1]) > 0.1 * max(weights)
    # The unnormalised gradient sums and every statistic (counts exact, sums up to float order).
    grads = whole.engine.replica.flat.buffer, split.engine.replica.flat.buffer
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    # Every logged figure but the timed ones (tok/s is these tokens over each run's own seconds).
    assert (a.selector_loss is None, b.selector_loss is None) == (flags["arch"] == "dflash",) * 2
    for name in ("loss", "grad_norm", "tau_hat", "flops") + ("selector_loss",) * (flags["arch"] == "dflash2"):
        assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-5), name
    assert b.acc == pytest.approx(a.acc, rel=1e-6)
    assert (b.tokens, b.row_tokens, b.draft_tokens) == (a.tokens, a.row_tokens, a.draft_tokens)
    for (name, p), q in zip(whole.drafter.named_parameters(), split.drafter.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def test_drafter_rows_that_do_not_divide_the_batch_are_refused_before_anything_loads(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"drafter_rows 3 does not divide --batch-size 4.*pass one of \[1, 2, 4\]"):
        TrainConfig(batch_size=4, drafter_rows=3)
    with pytest.raises(ValueError, match="drafter_rows -1 does not divide"):
        TrainConfig(batch_size=4, drafter_rows=-1)
    assert TrainConfig(batch_size=4, drafter_rows=0).drafter_rows == 0  # 0: the whole micro-batch
    out = tmp_path / "run"
    assert main(["train", "--batch-size", "4", "--drafter-rows", "3", "--out", str(out), "--no-progress"]) == 2
    assert "--drafter-rows 3 does not divide --batch-size 4" in caplog.text
    assert not out.exists()


def test_a_resume_may_change_the_rows_per_drafter_forward(assets, tmp_path):
    Trainer(settle(_config(assets, tmp_path / "run", save=True))).train()
    resumed = Trainer(settle(_config(assets, tmp_path / "run", save=True, steps=2, drafter_rows=2, resume=True)))
    assert resumed.step == 1
    resumed.train()
