"""Pipeline stages (work in progress): two stages of the tiny model, driven by torch's GPipe schedule over
gloo, give the whole model's logits and its gradients (a tied embedding's summed over the first and last
stage)."""

from __future__ import annotations

import copy
import os

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
