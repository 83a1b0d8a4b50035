"""dflash.distributed in one process: ordered gradient sums over replicas, flat gradient views,
the torchrun environment."""

import pytest
import torch

from dflash.distributed import FlatGradients, ProcessInfo, sum_replicas


def test_sum_replicas_on_cpu_is_an_ordered_sum_in_every_buffer():
    modules = [torch.nn.Linear(3, 2) for _ in range(3)]
    flats = [FlatGradients(m, extra=1) for m in modules]
    for i, (m, flat) in enumerate(zip(modules, flats)):
        m(torch.full((1, 3), float(i + 1))).sum().backward()
        flat.stats.fill_(i + 1)
    expected = (flats[0].buffer + flats[1].buffer) + flats[2].buffer
    sum_replicas([f.buffer for f in flats])
    for m, flat in zip(modules, flats):
        assert torch.equal(flat.buffer, expected)
        assert flat.stats.item() == 6.0
        flat.check_views()  # .grad still views the buffer
        assert torch.equal(m.weight.grad, flat.grads[0])


def test_flat_gradients_notice_a_replaced_grad_and_refuse_bf16_weights():
    module = torch.nn.Linear(2, 2)
    flat = FlatGradients(module)
    module.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="replaced"):
        flat.check_views()
    with pytest.raises(ValueError, match="fp32"):
        FlatGradients(torch.nn.Linear(2, 2).to(torch.bfloat16))


def test_process_info_rejects_a_bad_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="not a valid torchrun environment"):
        ProcessInfo.from_env()
