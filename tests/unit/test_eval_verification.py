"""`dflash eval` on a hybrid (Qwen3.6-layout) target: speculative outputs equal greedy decoding in
float32; a verification that is wrong (a planted rollback that forgets the linear-attention states)
exits non-zero, is counted in --json and acceptance.json, and is not quoted by dflash export."""

from __future__ import annotations

import json

import pytest
from tiny import save_random_drafter, write_chat_data

from dflash.cli import main
from dflash.run import acceptance_log
from dflash.target_model import rollback


@pytest.fixture(scope="module")
def run(hybrid_dir, tmp_path_factory):
    """(run directory with one random checkpoint for the hybrid target, held-out data)."""
    root = tmp_path_factory.mktemp("verification")
    save_random_drafter(hybrid_dir, root / "run")
    heldout = write_chat_data(root / "heldout.jsonl", repeat=1)
    (root / "run" / "train_config.json").write_text(json.dumps({"target": str(hybrid_dir), "data": str(heldout)}))
    return root / "run", heldout


def _eval(run_dir, heldout, capsys) -> tuple[int, dict]:
    argv = ["eval", "--drafter", str(run_dir), "--data", str(heldout), "--device", "cpu", "--cpu-threads", "1"]
    code = main([*argv, "--max-new-tokens", "16", "--num-prompts", "3", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_hybrid_eval_equals_greedy_decoding_and_says_so(run, capsys):
    run_dir, heldout = run
    code, report = _eval(run_dir, heldout, capsys)
    assert code == 0
    assert report["mismatches"] == 0 and report["dtype"] == "float32"
    assert report["histogram"].get("1", 0) > 0  # a random drafter: rejections, so rollbacks ran
    assert acceptance_log.read(run_dir)[-1]["mismatches"] == 0


def test_a_wrong_verification_exits_non_zero_and_is_not_quoted(run, capsys, monkeypatch, tmp_path):
    run_dir, heldout = run

    def keep_without_rollback(self, kept_ids, verified):  # the linear-attention states stay past the rejection
        rollback.crop(self.cache, verified + kept_ids.shape[1], skip=self.linear_layers)

    monkeypatch.setattr(rollback.StateRollback, "keep", keep_without_rollback)
    code, report = _eval(run_dir, heldout, capsys)
    assert code == 1
    assert 0 < report["mismatches"] <= report["num_prompts"] == 3
    assert acceptance_log.read(run_dir)[-1]["mismatches"] == report["mismatches"]
    out = tmp_path / "wrong-dflash"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert "Not quoted" in readme and "tau " not in readme
