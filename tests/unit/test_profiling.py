"""``dflash train --profile-step``: the profiled step's trace and its time by kernel kind and stage
(:mod:`dflash.profiling`). The CPU run checks the plumbing; the kinds are CUDA kernel names."""

import logging

import pytest
from tiny import make_target, train_config, write_chat_data

from dflash import profiling
from dflash.config import TrainConfig
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
        ("triton_tem_fused_flex_attention_0", "flex_attention"),
        ("triton_tem_fused_flex_attention_backward_1", "flex_attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention (SDPA)"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "matmul"),  # cutlass first: the memory-efficient kernel
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "Gated DeltaNet (fla)"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled fused (inductor)"),
        ("triton_poi_fused_mul_silu_1", "compiled fused (inductor)"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ],
)
def test_kernel_kinds(kernel, kind):
    assert profiling.kernel_kind(kernel).startswith(kind)


def test_a_profiled_step_writes_its_trace_and_logs_each_stage(tmp_path, caplog):
    config = train_config(
        target=make_target(tmp_path / "target", num_layers=5),
        data=write_chat_data(tmp_path / "train.jsonl", repeat=2),
        out=tmp_path / "run",
        steps=3,
        profile_step=2,
        save=False,
    )
    with caplog.at_level(logging.INFO, logger="dflash.profiling"):
        Trainer(settle(config)).train()
    assert (tmp_path / "run" / "profile_step2.json").stat().st_size > 0
    assert not (tmp_path / "run" / "profile_step1.json").exists()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dflash.profiling"]
    assert line.startswith("step 2 profile (CPU time of ops (no GPU)):"), line
    tables = dict(part.split(": ", 1) for part in line.splitlines()[1:])
    assert set(tables) == {"  step", f"  {profiling.TARGET_RANGE}", f"  {profiling.DRAFTER_RANGE}"}, line
    assert all(" ms (" in table and "nothing recorded" not in table for table in tables.values()), line


def test_a_profile_step_past_the_run_is_refused():
    with pytest.raises(ValueError, match=r"profile_step: step 5 is past the run's --steps 4"):
        TrainConfig(steps=4, profile_step=5)
    with pytest.raises(ValueError, match="profile_step must be >= 0"):
        TrainConfig(profile_step=-1)
