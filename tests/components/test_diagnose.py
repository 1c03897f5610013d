"""`reinforge diagnose`: the report as JSON with every check ok here, a service the environment names but
nobody serves fails (exit 1, with the fix), and a config whose model cannot fit fails its memory check."""

from __future__ import annotations

import json
import socket

import pytest

from components.diagnose import fits, run_checks
from flows.diagnose import main


@pytest.fixture
def no_pip_check(monkeypatch):
    """The service and config checks alone: `pip check` (a second or two) is the first test's."""
    import components.diagnose as d

    monkeypatch.setattr(d, "software", lambda: [])


def test_this_machine_reports_no_failure_as_json(capsys, monkeypatch):
    for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--device", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert {
        "python",
        "torch",
        "pip check",
        "cpu",
        "engine hf",
        "Ray",
        "bubblewrap",
        "free disk",
    } <= checks.keys()
    assert all(c["status"] in ("ok", "warn") for c in checks.values())


def test_an_unreachable_service_fails_naming_its_variable(monkeypatch, no_pip_check):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{port}/api")
    prefect = next(c for c in run_checks() if c.name == "Prefect")
    assert (
        prefect.status == "fail"
        and "PREFECT_API_URL" in prefect.found
        and "unset PREFECT_API_URL" in prefect.fix
    )
    assert main([]) == 1


def test_a_model_too_big_for_this_machine_fails_the_memory_check_with_the_options(tmp_path):
    from transformers import Qwen2Config

    big = tmp_path / "big"
    Qwen2Config(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
    ).save_pretrained(big)
    memory = next(c for c in fits(None, [f"actor.model.path={big}"]) if c.name == "memory")
    assert memory.status == "fail" and "M parameters" in memory.found
    assert "fsdp" in memory.fix and "actor.lora.rank" in memory.fix


def test_a_missing_package_fails_with_the_install_command(monkeypatch):
    import components.diagnose as d

    real = d._version
    monkeypatch.setattr(d, "_version", lambda dist: None if dist == "peft" else real(dist))
    peft = next(c for c in d.software() if c.name == "peft")
    assert (peft.status, peft.found, peft.fix) == ("fail", "not installed", "make install (pip install -e .)")


def test_an_nccl_older_than_2_18_warns():
    from components.diagnose import nccl_check

    assert nccl_check("2.17.1").status == "warn" and "newer NCCL" in nccl_check("2.17.1").fix
    assert nccl_check((2, 21, 5)).status == "ok"


def test_no_gpu_is_reported_without_failing():
    from components.diagnose import devices

    cuda = next(c for c in devices() if c.name == "cuda")  # this machine: the CPU wheel, no GPU
    assert cuda.status == "ok" and "no GPU visible" in cuda.found


def test_an_unreachable_ray_address_fails(monkeypatch, no_pip_check):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    ray = next(c for c in run_checks() if c.name == "Ray")
    assert ray.status == "fail" and "unset RAY_ADDRESS" in ray.fix


def test_a_config_needing_8_gpus_fails_on_this_machine(tiny_model_dir):
    overrides = [
        f"actor.model.path={tiny_model_dir}",
        "trainer.num_workers=8",
        "trainer.worker_resources={GPU: 1}",
    ]
    devices = next(c for c in fits(None, overrides) if c.name == "devices")
    assert devices.status == "fail" and "8 workers x 1 GPU, 0 GPUs here" in devices.found
    assert "RAY_ADDRESS" in devices.fix


def test_an_engine_older_than_its_adapter_needs_fails_with_the_upgrade():
    from components.diagnose import engine_too_old

    assert "pip install 'vllm>=0.10.2'" in engine_too_old("vllm", "0.8.5")
    assert engine_too_old("vllm", "0.11.0") == "" and engine_too_old("sglang", "0.5.2") == ""
    assert "unreadable" in engine_too_old("tensorrt_llm", "dev")


def test_ray_cluster_resources_are_described_without_its_node_entries():
    from components.diagnose import describe_resources

    resources = {
        "CPU": 16.0,
        "GPU": 8.0,
        "memory": 64 * 2**30,
        "node:10.0.0.1": 1.0,
        "accelerator_type:H100": 1.0,
    }
    assert describe_resources(resources) == "CPU 16, GPU 8, memory 64.0 GiB, accelerator_type:H100 1"


def test_an_unreachable_cluster_s_resources_say_why(monkeypatch):
    from components.diagnose import ray_cluster_resources

    monkeypatch.setattr("components.diagnose.RAY_RESOURCES", "import sys; sys.exit('connection refused')")
    assert ray_cluster_resources("127.0.0.1:1", timeout_s=30) == "connection refused"


def test_each_missing_engine_names_the_install_that_holds_it(monkeypatch):
    import importlib.util

    import components.diagnose as d

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    fixes = {c.name: c.fix for c in d.engines()}
    assert fixes["engine vllm"].startswith("pip install 'reinforge[gpu]'")
    assert (
        fixes["engine trtllm"].startswith("pip install tensorrt-llm")
        and "not in reinforge" in fixes["engine trtllm"]
    )
