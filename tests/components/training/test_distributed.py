"""Several policy workers as one process group (Ray actors, gloo on CPU): one update with 2 workers (ddp,
fsdp full and hybrid) gives the parameters of 1 worker within 1e-5; shards are token-balanced; a checkpoint
written by 2 fsdp workers loads into 1; and adaptive gradient compression switches on a slow link."""

from __future__ import annotations

import pytest
import ray
import torch

from components.models import build_tiny_model
from components.plan import make_plan
from components.training.local_workers import local_policy_group
from components.training.loop import balanced_shards
from components.training.ray_workers import policy_group
from components.validate import load_checked
from tests.components.training.test_actor import synthetic_batch


def config(model_dir, *extra: str):
    # SGD: Adam's first step is lr x sign(grad), which turns rounding noise in tiny gradients into lr-sized steps
    return load_checked(
        None,
        [
            f"actor.model.path={model_dir}",
            "data.batch_size=2",
            "engine.n=4",
            "actor.optimizer.type=sgd",
            "actor.optimizer.lr=0.05",
            "actor.optimizer.grad_clip=1000",
            "trainer.num_threads=1",
            "trainer.grad_compression=none",
            *extra,
        ],
    )


# one worker's result for a config, reused by the layouts compared with it (the same inputs, deterministic)
_ONE_WORKER: dict[tuple[str, int], tuple[dict[str, torch.Tensor], list[dict]]] = {}


def group_of(cfg, n: int):
    """n policy workers of `cfg` as Ray actors; one in this process (a group of one joins no process group:
    it runs as in an actor of its own, without a process that imports torch again)."""
    return local_policy_group(make_plan(cfg)) if n == 1 else policy_group(make_plan(cfg), n)


def one_update(cfg, tokenizer, n: int, steps: int = 1) -> tuple[dict[str, torch.Tensor], list[dict]]:
    key = (cfg.model_dump_json(), steps)
    if n == 1 and key in _ONE_WORKER:
        return _ONE_WORKER[key]
    group = group_of(cfg, n)
    try:
        metrics = [group.update(synthetic_batch(tokenizer, seed=s)) for s in range(steps)]
        # every rank joins the gather
        weights = group.wait([a.get_weights.remote() for a in group.actors], "get_weights")[0][0]
        result = {k: v.clone() for k, v in weights.items()}, metrics
    finally:
        group.stop()
    if n == 1:
        _ONE_WORKER[key] = result
    return result


INITIAL: dict[str, torch.Tensor] = {}
# 2 epochs x 2 mini-batches, micro-batches packed to a 20-token budget
PPO_LOOP = [
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_epochs=2",
    "actor.ppo_max_token_len_per_worker=20",
    "actor.model.max_seq_len=20",
    "data.max_prompt_len=4",
    "engine.max_new_tokens=8",
]


@pytest.fixture(autouse=True)
def _initial(tiny_model_dir):
    from components.models import load_model

    INITIAL.update({k: v.clone() for k, v in load_model(tiny_model_dir).state_dict().items()})


def assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"largest parameter difference {worst:.2e} > {atol:g}"


# ddp here is the case with mini-batches, epochs and packed micro-batches (plain ddp: the powersgd test below);
# tensor parallelism over a whole run through the flow: tests/flows/test_multi_worker.py
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp-hybrid", "ddp-minibatches-tokens", "ddp-lora"])
def test_two_workers_update_like_one(ray_up, tiny_model_dir, tokenizer, strategy):
    extra = ["trainer.strategy=" + strategy.split("-")[0]]
    if strategy.endswith("minibatches-tokens"):
        extra += PPO_LOOP
    if strategy.endswith("lora"):  # the weights compared are the adapters, what the engine is sent
        extra += ["actor.lora.rank=4"]
    n, group = 2, ["trainer.num_workers=2"]
    if strategy == "fsdp-hybrid":  # 2 replicas, each sharded over 2 workers
        n, group = 4, ["trainer.num_workers=4", "trainer.data_parallel_size=2"]
    one, m1 = one_update(config(tiny_model_dir, *extra), tokenizer, 1)
    two, m2 = one_update(config(tiny_model_dir, *extra, *group), tokenizer, n)
    assert_same(one, two, 1e-5)
    start = INITIAL if not strategy.endswith("lora") else {k: torch.zeros_like(v) for k, v in one.items()}
    moved = [float((one[k] - start[k]).abs().max()) for k in one if "lora_A" not in k]
    assert max(moved) > 1e-3  # the update moved the weights (a LoRA's B from zero)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(m1[0][key] - m2[0][key]) <= 1e-4 * max(1.0, abs(m1[0][key])), (key, m1[0][key], m2[0][key])


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param(("2", "1", []), id="tp2"),
        pytest.param(
            ("2", "2", ["trainer.strategy=fsdp", "actor.sequence_parallel=true"]),
            id="tp2xdp2-sequence-parallel",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_tensor_parallel_updates_like_one_worker(ray_up, tiny_model_dir, tokenizer, mesh):
    """Tensor parallel (DTensor, the architecture's own plan; with the sequence split between the blocks;
    with FSDP over the data-parallel replicas):
    two PPO epochs over two mini-batches with micro-batches packed to a token budget, then a second update,
    give one worker's parameters within 1e-5, and the same loss, entropy and gradient norm."""
    tp, dp, extra = mesh
    loop = PPO_LOOP
    n = int(tp) * int(dp)
    one, m1 = one_update(config(tiny_model_dir, *loop), tokenizer, 1, 2)
    split, m2 = one_update(
        config(
            tiny_model_dir,
            *loop,
            *extra,
            f"trainer.num_workers={n}",
            f"actor.tensor_model_parallel_size={tp}",
        ),
        tokenizer,
        n,
        2,
    )
    assert_same(one, split, 1e-5)
    assert max(float((one[k] - INITIAL[k]).abs().max()) for k in one) > 1e-3
    for step in range(2):
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            a, b = m1[step][key], m2[step][key]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, key, a, b)


ADAM = ["actor.optimizer.type=adamw", "actor.optimizer.lr=1e-3"]  # moments a resume must restore


def save_and_reload(cfg, n: int, tokenizer, out) -> tuple[dict[str, torch.Tensor], list[int]]:
    """A group of n: one update, a checkpoint into `out`, loaded back and written again into `out`_again.
    Returns the weights the group serves to the rollout engine and the parameter elements each worker holds."""
    group = group_of(cfg, n)
    try:
        group.update(synthetic_batch(tokenizer, seed=0))
        group.write_checkpoint(str(out), True)
        served = group.wait([a.get_weights.remote() for a in group.actors], "get_weights")[0][0]
        held = group.wait([a.parameter_count.remote() for a in group.actors], "parameter_count")
        group.load_checkpoint(str(out))
        group.write_checkpoint(f"{out}_again", True)
    finally:
        group.stop()
    return served, held


def reload_in_one_worker(cfg, source, out) -> int:
    """One worker loads the checkpoint `source` and writes it into `out`; the parameter elements it holds."""
    one = group_of(cfg, 1)
    try:
        one.load_checkpoint(str(source))
        one.write_checkpoint(str(out), True)
        return one.wait([one.actors[0].parameter_count.remote()], "parameter_count")[0]
    finally:
        one.stop()


def assert_same_checkpoints(reference, *others) -> dict[str, torch.Tensor]:
    """The model as loaded (a tied head is one tensor, however the writer stored it) and the optimizer as
    stored are bit-identical; returns the reference's model state."""
    from safetensors.torch import load_file

    from components.models import load_model

    saved = load_model(reference / "model").state_dict()
    for other in others:
        b = load_model(other / "model").state_dict()
        assert saved.keys() == b.keys() and all(torch.equal(saved[k], b[k]) for k in saved), other
        a, b = (load_file(d / "optimizer.safetensors") for d in (reference, other))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), other
    return saved


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory, tokenizer):
    """A tiny model deep enough for two pipeline stages, saved once for the module; its initial weights."""
    from components.models.loading import save_pretrained

    model = build_tiny_model(
        tokenizer, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64, max_positions=64, seed=0
    )
    start = {k: v.clone() for k, v in model.state_dict().items()}
    return save_pretrained(model, tokenizer, tmp_path_factory.mktemp("three_layers") / "model"), start


# (workers, extra overrides): two stages alone (GPipe), two pipelines of two stages (data parallel), two stages
# each split over two tensor-parallel workers (both 1F1B, the default schedule)
PIPELINES = {
    "pp2-gpipe": (2, ["actor.pipeline_schedule=gpipe"]),
    "pp2xdp2": (4, []),
    "pp2xtp2": (4, ["actor.tensor_model_parallel_size=2"]),
}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_pipeline_parallel_updates_like_one_worker(ray_up, three_layers, tokenizer, layout):
    """Two pipeline stages (the tied embedding on the first and last), alone, as two data-parallel pipelines,
    or each split over two TP workers: PPO epochs, mini-batches and a token budget over two updates give one
    worker's parameters within 1e-5 and the same metrics."""
    model_dir, start = three_layers
    n, extra = PIPELINES[layout]
    one, m1 = one_update(config(model_dir, *PPO_LOOP), tokenizer, 1, 2)
    pp = [
        f"trainer.num_workers={n}",
        "actor.pipeline_model_parallel_size=2",
        "actor.pipeline_microbatches=2",
        *extra,
    ]
    split, m2 = one_update(config(model_dir, *PPO_LOOP, *pp), tokenizer, n, 2)
    assert_same(one, split, 1e-5)
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-3
    for step in range(2):
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            a, b = m1[step][key], m2[step][key]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, key, a, b)


def test_a_pipeline_checkpoint_resumes_in_one_worker_and_back(ray_up, three_layers, tmp_path, tokenizer):
    """A full checkpoint of two pipeline stages each split over two TP workers (AdamW moments, a tied
    embedding held by both ends) loads into one worker and back into the 2x2 mesh, each writing it again
    bit-identical; its weights are what the stages serve to the rollout engine."""
    model_dir, start = three_layers
    mesh = [
        "trainer.num_workers=4",
        "actor.pipeline_model_parallel_size=2",
        "actor.tensor_model_parallel_size=2",
    ]
    served, _ = save_and_reload(config(model_dir, *ADAM, *mesh), 4, tokenizer, tmp_path / "pp2xtp2")
    reload_in_one_worker(config(model_dir, *ADAM), tmp_path / "pp2xtp2", tmp_path / "one")
    saved = assert_same_checkpoints(tmp_path / "pp2xtp2", tmp_path / "one", tmp_path / "pp2xtp2_again")
    assert max(float((saved[k] - start[k]).abs().max()) for k in saved) > 1e-4  # trained
    assert all(torch.equal(served[k], saved[k]) for k in saved)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_in_one_worker(
    ray_up, tiny_model_dir, tokenizer, tmp_path
):
    """Two DDP workers with LoRA adapters (AdamW moments for the adapters alone) write a checkpoint: the
    merged model beside the peft adapter directory; one worker resumes it and writes it again bit-identical,
    and what the group served the engine is those adapters."""
    from safetensors.torch import load_file

    lora = [*ADAM, "actor.lora.rank=4"]
    two = config(tiny_model_dir, *lora, "trainer.num_workers=2")
    served, _ = save_and_reload(two, 2, tokenizer, tmp_path / "two")
    reload_in_one_worker(config(tiny_model_dir, *lora), tmp_path / "two", tmp_path / "one")
    assert_same_checkpoints(tmp_path / "two", tmp_path / "one", tmp_path / "two_again")
    a, b = (
        load_file(tmp_path / d / "model" / "adapter" / "adapter_model.safetensors") for d in ("two", "one")
    )
    assert a.keys() == b.keys() == served.keys()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], served[k]) for k in a)


@pytest.mark.parametrize(
    "layout", [["actor.tensor_model_parallel_size=2"], ["trainer.strategy=fsdp"]], ids=["tp2", "fsdp2"]
)
def test_a_sharded_groups_checkpoint_reshards_to_one_worker_and_back(
    ray_up, tiny_model_dir, tokenizer, tmp_path, layout
):
    """A checkpoint written by 2 workers that split the model (tensor parallel, or FSDP; AdamW: moments to
    restore) holds whole tensors: one worker loads it and writes it back bit-identical, and so does a group of
    2; its weights are what the group serves to the rollout engine, and each worker of the group holds less
    of the model than one worker does."""
    cfg = config(tiny_model_dir, *ADAM, "trainer.num_workers=2", *layout)
    served, held = save_and_reload(cfg, 2, tokenizer, tmp_path / "two")
    whole = reload_in_one_worker(config(tiny_model_dir, *ADAM), tmp_path / "two", tmp_path / "one")
    saved = assert_same_checkpoints(tmp_path / "two", tmp_path / "one", tmp_path / "two_again")
    assert all(torch.equal(served[k], saved[k]) for k in saved)
    assert all(h < whole for h in held) and sum(held) >= whole, (held, whole)  # split (TP: norms whole)


def test_a_sharded_checkpoint_is_written_by_every_worker_and_read_by_any_layout(
    ray_up, tiny_model_dir, tokenizer, tmp_path
):
    """trainer.checkpoint_format=sharded: two tensor-parallel workers each write their shards (safetensors);
    one worker reads them (resharding) and a TP2 group reads them back, and both then hold exactly the trained
    weights and the same optimizer state."""
    from safetensors.torch import load_file

    from components.models import load_model

    common = ["actor.optimizer.type=adamw", "actor.optimizer.lr=1e-3"]
    tp = ["trainer.num_workers=2", "actor.tensor_model_parallel_size=2"]
    group = policy_group(
        make_plan(config(tiny_model_dir, *common, *tp, "trainer.checkpoint_format=sharded")), 2
    )
    try:
        group.update(synthetic_batch(tokenizer, seed=0))
        group.write_checkpoint(str(tmp_path / "sharded"), True)
        trained = group.wait([a.get_weights.remote() for a in group.actors], "get_weights")[0][0]
        group.load_checkpoint(str(tmp_path / "sharded"))
        group.write_checkpoint(str(tmp_path / "sharded_again"), True)
    finally:
        group.stop()
    shards = sorted(p.name for p in (tmp_path / "sharded" / "model" / "shards").glob("*.safetensors"))
    assert len(shards) == 2, shards  # one file per worker
    assert not (tmp_path / "sharded" / "model" / "model.safetensors").exists()  # no gathered copy
    # the full checkpoints these load into: one worker (resharded), and TP2 from its own sharded one
    outs = {}
    for name, n, layout, source in (("one", 1, [], "sharded"), ("tp2", 2, tp, "sharded_again")):
        g = group_of(config(tiny_model_dir, *common, *layout), n)
        try:
            g.load_checkpoint(str(tmp_path / source))
            g.write_checkpoint(str(tmp_path / f"{name}_full"), True)
        finally:
            g.stop()
        outs[name] = (
            load_model(tmp_path / f"{name}_full" / "model").state_dict(),
            load_file(tmp_path / f"{name}_full" / "optimizer.safetensors"),
        )
    (m1, o1), (m2, o2) = outs["one"], outs["tp2"]
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)
    assert o1.keys() == o2.keys() and all(torch.equal(o1[k], o2[k]) for k in o1)
    assert all(torch.equal(m1[k], trained[k]) for k in m1)  # exactly the trained weights
    from components.models.convert import to_hf

    merged = load_model(to_hf(tmp_path / "sharded", tmp_path / "merged")).state_dict()  # the model merger
    assert merged.keys() == m1.keys() and all(torch.equal(merged[k], m1[k]) for k in m1)
    assert max(float((m1[k] - INITIAL[k]).abs().max()) for k in m1) > 1e-4


def test_shards_are_token_balanced_with_equal_rows(tokenizer):
    b = synthetic_batch(tokenizer, n=8)
    shards = balanced_shards(b, 2)
    assert sorted(i for s in shards for i in s) == list(range(8)) and [len(s) for s in shards] == [4, 4]
    lengths = (b.tensors["prompt_mask"].sum(1) + b.tensors["response_mask"].sum(1)).tolist()
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= max(lengths) - min(lengths)


def test_slow_link_switches_to_powersgd_and_learns_like_uncompressed(ray_up, tiny_model_dir, tokenizer):
    base = ["trainer.strategy=ddp", "trainer.num_workers=2"]
    plain, m_plain = one_update(
        config(tiny_model_dir, *base, "trainer.grad_compression=none"), tokenizer, 2, 6
    )
    slow, m_slow = one_update(
        config(
            tiny_model_dir, *base, "trainer.grad_compression=auto", "trainer.simulated_bandwidth_gbps=0.02"
        ),
        tokenizer,
        2,
        6,
    )
    assert m_slow[-1]["perf/grad_compression"] == 2 and m_slow[-1]["perf/grad_compression_rank"] == 1
    assert m_slow[-1]["perf/allreduce_gbps"] <= 0.021
    assert m_plain[-1]["perf/grad_compression"] == 0  # none, as asked
    loss_plain = [m["actor/pg_loss"] for m in m_plain]
    loss_slow = [m["actor/pg_loss"] for m in m_slow]
    # the same batches: the loss curves agree within 0.05 (PowerSGD starts after 2 exact steps)
    assert max(abs(a - b) for a, b in zip(loss_plain, loss_slow)) < 0.05, (loss_plain, loss_slow)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_updates_like_one_worker(ray_up, tiny_model_dir, tokenizer, stage):
    pytest.importorskip("deepspeed", reason="deepspeed is in the gpu extra: pip install 'reinforge[gpu]'")
    one, m1 = one_update(config(tiny_model_dir), tokenizer, 1)
    two, m2 = one_update(
        config(
            tiny_model_dir,
            "trainer.strategy=deepspeed",
            "trainer.num_workers=2",
            f"trainer.zero_stage={stage}",
            "trainer.save_optimizer=false",
        ),
        tokenizer,
        2,
    )
    assert_same(one, two, 1e-5)
    assert max(float((one[k] - INITIAL[k]).abs().max()) for k in one) > 1e-3
    assert abs(m1[0]["actor/grad_norm"] - m2[0]["actor/grad_norm"]) <= 1e-4 * max(
        1.0, m1[0]["actor/grad_norm"]
    )


def test_a_group_is_refused_or_shrinks_to_what_the_cluster_holds_as_min_workers_says(ray_up, tiny_model_dir):
    from components.errors import ResourceError
    from components.training.ray_workers import workers_that_fit

    def fit(*overrides: str) -> int:
        return workers_that_fit(
            make_plan(config(tiny_model_dir, "data.batch_size=16", "engine.n=4", *overrides))
        )

    free = int(ray.cluster_resources()["CPU"]) - 1  # the rollout actor takes one
    # asked for more than fit, and no fewer allowed: refused, naming the key and the way out
    with pytest.raises(
        ResourceError, match=r"room for \d+ policy worker\(s\) .* trainer.num_workers=64\. .*min_workers"
    ):
        fit("trainer.num_workers=64")
    n = fit("trainer.num_workers=64", "trainer.min_workers=1")
    assert n == max(k for k in range(1, free + 1) if 64 % k == 0)  # fits, and still splits the batch evenly
    with pytest.raises(ResourceError, match=r"room for \d+ policy worker\(s\) .* trainer.min_workers=63\. "):
        fit("trainer.num_workers=64", "trainer.min_workers=63")
    assert fit("trainer.num_workers=2") == 2  # what fits is given as asked
    # engines that ask for a resource no node has would wait for it until the stage timeout: refused at once
    from components.training.ray_workers import engines_fit

    cfg = config(
        tiny_model_dir, "trainer.rollout_placement=separate", "trainer.rollout_resources={sampler: 1}"
    )
    with pytest.raises(
        ResourceError, match=r"trainer.rollout_resources=\{'sampler': 1.0\}: the Ray cluster has "
    ):
        engines_fit(make_plan(cfg).placement)
