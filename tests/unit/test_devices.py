"""dflash.devices: the device-spec grammar of --target-devices/--drafter-devices and its errors."""

import json

import pytest
import torch

from dflash.cli import main
from dflash.devices import DeviceSpecError, parse_devices, parse_layout, set_cpu_threads


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cuda:0", "CUDA is not available"),
        ("cpu:3-1", "descending range; write cpu:1-3"),
        ("gpu:0", "'gpu:0' is not a device"),
        ("cpu,,cpu:1", "empty device item"),
        ("cpu:0,cpu:0", "cpu:0 listed twice"),
        ("2", "'2' has no device type"),
    ],
)
def test_bad_device_specs_are_named(spec, message):
    with pytest.raises(DeviceSpecError, match=message):
        parse_devices(spec, flag="--drafter-devices")


def test_device_specs_parse(monkeypatch):
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 4)
    assert [s.name for s in parse_devices("cpu:0-2", flag="x")] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [s.name for s in parse_devices("cpu:0,2", flag="x")] == ["cpu:0", "cpu:2"]
    layout = parse_layout("cpu", "cpu:0-1")
    assert layout.device_type == "cpu" and len(layout.drafters) == 2


def test_missing_gpu_names_the_gpu_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceSpecError, match=r"cuda:5 does not exist; this host has 2 GPU\(s\) \(cuda:0..cuda:1\)"):
        parse_devices("cuda:0,5", flag="--drafter-devices")
    with pytest.raises(DeviceSpecError, match="mix cpu and cuda"):
        parse_layout("cuda:0", "cpu")


def test_cli_reports_bad_layouts(tmp_path, caplog):
    base = ["train", "--out", str(tmp_path)]
    assert main(base + ["--target-devices", "cpu", "--drafter-devices", "cpu:1-0"]) == 2
    assert "descending range" in caplog.text
    assert main(base + ["--drafter-devices", "cpu"]) == 2
    assert "give both --target-devices and --drafter-devices" in caplog.text
    assert main(base + ["--device", "cpu", "--target-devices", "cpu", "--drafter-devices", "cpu"]) == 2
    assert "--device cpu is the single-device path" in caplog.text and "drop --device" in caplog.text


def test_cpu_slots_past_the_core_count_are_refused(monkeypatch):
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 2)
    assert len(parse_devices("cpu:0-1", flag="--drafter-devices")) == 2
    with pytest.raises(DeviceSpecError, match=r"cpu:2 is past the 2 CPU core.*use cpu:0-1 or fewer"):
        parse_devices("cpu:0-999", flag="--drafter-devices")


def test_a_resumed_layout_run_drops_the_saved_device(tmp_path):
    from dflash.commands.train import _resumed_values

    saved = {"device": "cuda", "target_devices": "cpu", "drafter_devices": "cpu:0-1", "steps": 9}
    (tmp_path / "train_config.json").write_text(json.dumps(saved))
    given = {"resume": True, "out": str(tmp_path)}
    # Runs saved before --device and the layout flags were exclusive hold both; the layout wins.
    assert _resumed_values(given) == {**given, "target_devices": "cpu", "drafter_devices": "cpu:0-1", "steps": 9}
    assert _resumed_values({**given, "device": "cpu"})["device"] == "cpu"  # given again: checked as usual
    (tmp_path / "train_config.json").write_text(json.dumps({"device": "cuda", "steps": 9}))
    assert _resumed_values(given)["device"] == "cuda"


@pytest.fixture
def host(monkeypatch):
    """A 2-core host whose load average the test sets; torch's threads put back afterwards."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 2)
    load = {"1min": 0.0}
    monkeypatch.setattr("os.getloadavg", lambda: (load["1min"], 0.0, 0.0))
    yield load
    torch.set_num_threads(threads)


@pytest.mark.parametrize("load, processes, threads", [(3.1, 1, 1), (1.4, 1, 1), (0.4, 1, 2), (0.0, 2, 1)])
def test_a_cpu_run_left_at_the_default_takes_the_cores_other_jobs_leave_free(
    host, monkeypatch, caplog, load, processes, threads
):
    """torch's default took both cores of a shared 2-core machine: the same run 3.4x slower, unsaid."""
    host["1min"] = load
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    torch.set_num_threads(2 if threads == 1 else 1)
    with caplog.at_level("INFO", logger="dflash.devices"):
        set_cpu_threads(None, "cpu")
    assert torch.get_num_threads() == threads
    assert (
        f"--cpu-threads not given: {threads} torch thread(s), {threads} of the 2 CPU core(s) this process may use"
    ) in caplog.text
    assert f"less the 1-minute load average, {load:.1f}" in caplog.text and "pass --cpu-threads N" in caplog.text


def test_threads_given_by_flag_or_omp_num_threads_or_on_a_gpu_run_are_kept(host, monkeypatch, caplog):
    host["1min"] = 3.0
    set_cpu_threads(2, "cpu")
    assert torch.get_num_threads() == 2
    set_cpu_threads(None, "cuda")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    set_cpu_threads(None, "cpu")
    assert torch.get_num_threads() == 2 and "--cpu-threads not given" not in caplog.text
