"""Pipeline stages: two stages of the tiny model, driven by torch's GPipe schedule over gloo, give the whole
model's logits and its gradients (a tied embedding's summed over the first and last stage); what this version
cannot do fails at config validation. (The update through the Ray worker group against one worker, and its
checkpoints: tests/components/training/test_distributed.py.)"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from components.models.tiny import build_char_tokenizer, build_tiny_model
from components.training.distributed import free_port
from components.training.logprobs import sequence_inputs
from components.training.pipeline_parallel import StageModule, prune_to_stage


def _stage(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    whole = build_tiny_model(
        tok, hidden_size=32, num_layers=4, num_heads=4, intermediate_size=64, max_positions=64, seed=0
    )
    module = StageModule(prune_to_stage(copy.deepcopy(whole), world, rank), rank == 0)
    g = torch.Generator().manual_seed(1)
    prompts, responses = torch.randint(5, 40, (4, 6), generator=g), torch.randint(5, 40, (4, 5), generator=g)
    p_mask, r_mask = torch.ones_like(prompts), torch.ones_like(responses)
    p_mask[0, :2], r_mask[1, 3:] = 0, 0
    ids, mask, pos = sequence_inputs(prompts, p_mask, responses, r_mask)
    schedule = ScheduleGPipe(
        PipelineStage(module, rank, world, torch.device("cpu")),
        n_microbatches=2,
        loss_fn=lambda logits, target: logits.float().logsumexp(-1).sum(),
        scale_grads=False,
    )
    kwargs = {"attention_mask": mask, "position_ids": pos}
    if rank == 0:
        schedule.step(ids, **kwargs)
    else:
        logits = schedule.step(**kwargs, target=torch.zeros(len(ids)))
    reference = whole(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    reference.float().logsumexp(-1).sum().backward()
    full = dict(whole.named_parameters())
    tied = torch.zeros_like(full["model.embed_tokens.weight"])
    worst = 0.0
    for name, p in module.lm.named_parameters():
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            tied += p.grad
        else:
            worst = max(worst, float((p.grad - full[name].grad).abs().max()))
    dist.all_reduce(tied)
    worst = max(worst, float((tied - full["model.embed_tokens.weight"].grad).abs().max()))
    owned = sum(p.numel() for p in module.lm.parameters())
    result = {"grad": worst, "owned": owned, "whole": sum(p.numel() for p in whole.parameters())}
    if rank == world - 1:
        result["logits"] = float((logits - reference).abs().max())
    torch.save(result, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_two_stages_give_the_whole_models_logits_and_gradients(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_stage, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    first, last = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert last["logits"] == 0.0
    assert first["grad"] < 1e-6 and last["grad"] < 1e-6
    assert first["owned"] < first["whole"] and last["owned"] < last["whole"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["trainer.num_workers=2", "actor.pipeline_model_parallel_size=2"],
            r"actor\.pipeline_model_parallel_size=2 is more than the 1 decoder layers of actor\.model\.path",
        ),
        (
            ["trainer.num_workers=3", "actor.pipeline_model_parallel_size=2"],
            r"actor\.pipeline_model_parallel_size=2 must divide trainer\.num_workers=3 .*multiple of 2",
        ),
        (
            [
                "trainer.num_workers=4",
                "actor.pipeline_model_parallel_size=2",
                "trainer.strategy=fsdp",
            ],
            r"trainer\.strategy=fsdp with actor\.pipeline_model_parallel_size=2 and 2 pipelines: .*set "
            r"trainer\.strategy=ddp",
        ),
        (
            ["trainer.num_workers=2", "actor.pipeline_model_parallel_size=2", "algorithm.name=ppo"],
            r"actor\.pipeline_model_parallel_size=2 with a critic \(adv_estimator gae\) is not supported",
        ),
        (
            [
                "trainer.num_workers=2",
                "actor.pipeline_model_parallel_size=2",
                "trainer.checkpoint_format=sharded",
            ],
            r"with trainer\.checkpoint_format=sharded is not supported",
        ),
    ],
)
def test_what_pipelines_cannot_do_fails_before_any_work_naming_the_key(tiny_model_dir, overrides, match):
    from components.errors import ConfigError
    from components.validate import load_checked

    with pytest.raises(ConfigError, match=match):
        load_checked(
            None, [f"actor.model.path={tiny_model_dir}", "data.batch_size=2", "engine.n=4", *overrides]
        )
