"""A rollout worker: tokenizer + engine; rows in, Batch out. Run as a Ray actor by the training flow."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import torch

from components.batch import Batch
from components.data.prompts import encode_prompt
from components.envs.base import COUNTERS, ENV_COUNT
from components.models.loading import load_image_encoder, load_tokenizer
from components.rollout.base import PromptImages, RolloutOutput, continue_samples, make_engine
from components.rollout.batching import rollout_batch
from components.rollout.multi_turn import first_messages, make_tools, play_episodes
from components.seeding import derive_seed
from components.settings import (
    EngineOptions,
    LoraSettings,
    MultiTurnSettings,
    PromptSettings,
    RolloutSettings,
    SamplingParams,
)


class RolloutWorker:
    def __init__(
        self,
        model_path: str,
        engine_type: str = "hf",
        options: EngineOptions | None = None,
        num_threads: int = 2,
        key: str = "actor.model.path",
        model=None,
        multi_turn: MultiTurnSettings | None = None,
        prompts: PromptSettings | None = None,
        lora: LoraSettings | None = None,
        partial: bool = False,
    ):
        """`model`: sample with this module (a colocated policy's own) instead of loading a copy.
        `multi_turn`: samples may call tools between turns (components/rollout/multi_turn.py). `prompts`: how a
        row's prompt becomes token ids (data.apply_chat_template), the same as in SFT. `lora`: the policy's
        adapters, which a copy of its own holds over the base and receives alone (set here, in the
        constructor, so an actor Ray restarts holds them again). `partial`: RolloutSettings.partial."""
        torch.set_num_threads(num_threads)
        trust = (options or EngineOptions()).trust_remote_code
        self.tokenizer = load_tokenizer(model_path, key, trust)
        self.images = load_image_encoder(model_path, self.tokenizer, key, trust)  # None: a text-only policy
        self.prompts = prompts or PromptSettings()
        self.engine = make_engine(
            engine_type,
            model_path,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
            options or EngineOptions(dtype="float32"),
            model=model,
            key=key,
        )
        self.multi_turn = multi_turn
        self.max_context = (options or EngineOptions()).max_model_len  # an episode's turns must fit it
        self.tools, self.episodes = {}, None  # the tools real models see; a new environment per episode
        if multi_turn:
            from components.envs.base import episode_factory

            self.tools = make_tools(list(multi_turn.tools), multi_turn.sandbox_limits, multi_turn.concurrency)
            multi_turn = replace(multi_turn, eos_token=self.tokenizer.eos_token)
            self.episodes = {
                name: episode_factory(name, multi_turn, self.tools) for name in multi_turn.played
            }
        if lora is not None and model is None:  # a colocated engine samples with the policy's own adapters
            self.engine.use_adapters(lora)
        self.partial = partial
        # the engine is used by one thread at a time: an update (its own Ray concurrency group with partial
        # rollouts) announces itself, and a partial rollout lets it in between two decode steps
        self.engine_lock, self.update_waiting = threading.Lock(), threading.Event()

    @classmethod
    def from_settings(cls, s: RolloutSettings, model=None, key: str = "actor.model.path") -> RolloutWorker:
        return cls(
            s.model_path,
            s.engine_type,
            s.options,
            s.num_threads,
            key=key,
            model=model,
            multi_turn=s.multi_turn,
            prompts=s.prompts,
            lora=s.lora,
            partial=s.partial,
        )

    def pid(self) -> int:
        return os.getpid()

    def weights_version(self) -> int:
        return self.engine.weights_version

    def health(self) -> int:
        """A one-token greedy generation; returns this process's pid (a changed pid = Ray restarted it)."""
        self.engine.wake()
        out = self.engine.generate(
            [[self.tokenizer.eos_token_id]], SamplingParams(n=1, temperature=0.0, max_new_tokens=1), seed=0
        )
        if out.responses.shape[0] != 1:
            raise RuntimeError("the engine's health-check generation returned no sample")
        return os.getpid()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Load the policy's weights `version`; during a partial rollout, between two of its decode steps
        (its samples are then finished with these weights)."""
        self.update_waiting.set()
        try:
            with self.engine_lock:
                self.engine.wake()  # a sleeping engine has its weights offloaded
                self.engine.update_weights(state_dict, version)
                return self.engine.weights_version
        finally:
            self.update_waiting.clear()

    def generate(
        self,
        rows: list[dict],
        params: SamplingParams,
        seed: int,
        iteration: int,
        expect_version: int | None = None,
        greedy_baseline: bool = False,
    ) -> Batch:
        """Sample params.n completions per row; refuses to sample with weights other than expect_version
        (with partial rollouts, newer ones are taken: an update may have landed while this call waited).

        greedy_baseline (remax) also decodes one greedy completion per row, as `baseline_responses` /
        `baseline_mask` repeated over the row's n samples. With partial rollouts, an update announced during a
        training rollout stops its samples after the current decode step; the update is loaded and the
        unfinished samples are continued with the new weights (their prompt and tokens so far prefilled
        again), flagged `partial_rollout`. `sample_version` stays the version each sample began with, so
        staleness counts its oldest tokens.
        """
        start = time.perf_counter()
        with self.engine_lock:
            held = self.engine.weights_version
            if (
                expect_version is not None
                and held != expect_version
                and not (self.partial and held > expect_version)
            ):
                raise RuntimeError(
                    f"rollout engine holds weights version {held}, the policy is at {expect_version}: sync "
                    "weights before sampling"
                )
            batch = self.sample(rows, params, seed, iteration, greedy_baseline)
            if iteration >= 0:  # a training rollout: the policy update comes next
                self.engine.sleep()
        batch.meta["gen_seconds"] = time.perf_counter() - start  # in the worker: the stage's compute
        return batch

    def sample(
        self, rows: list[dict], params: SamplingParams, seed: int, iteration: int, greedy: bool
    ) -> Batch:
        """The rollout, with the weights the engine holds (the caller holds the engine)."""
        self.engine.wake()
        envs, given = None, rows
        if self.multi_turn:  # each sample an episode; an environment may give a row's first messages itself
            m = self.multi_turn
            names = [self.env_of(row) for row in rows for _ in range(params.n)]
            envs = [self.episodes[name]() for name in names]
            rows = first_messages(rows, envs, params.n, seed, names, m.step_timeout_s)
        prompt_ids, images = self.encode(rows, given)
        continued = torch.zeros(len(rows) * params.n, dtype=torch.bool)
        if envs is not None:
            mt = play_episodes(
                self.engine,
                self.tokenizer,
                prompt_ids,
                params,
                seed,
                envs,
                m.max_turns,
                m.max_tool_chars,
                names,
                m.step_timeout_s,
                self.max_context,
            )
            batch = rollout_batch(rows, prompt_ids, mt.out, params.n, self.tokenizer.pad_token_id, iteration)
            batch = batch.union(
                response_attention_mask=mt.attention_mask,
                num_turns=mt.num_turns,
                tool_calls=mt.tool_calls,
                tool_errors=mt.tool_errors,
                env_reward=mt.rewards,
                **{
                    f"{ENV_COUNT}{name}": values
                    for name, values in self.counted(mt.counts, len(names)).items()
                },
            ).with_non_tensors(env=names)
            batch.meta["env_counters"] = {name: COUNTERS.get(name, ()) for name in m.played}
        elif self.partial and iteration >= 0 and images is None:
            out, continued = self.sample_partial(prompt_ids, params, seed)
            batch = rollout_batch(rows, prompt_ids, out, params.n, self.tokenizer.pad_token_id, iteration)
        else:
            out = self.engine.generate(prompt_ids, params, seed, images)
            batch = rollout_batch(rows, prompt_ids, out, params.n, self.tokenizer.pad_token_id, iteration)
        batch = batch.union(partial_rollout=continued)
        if images is not None:  # the trainer scores the samples with the pixels the hf engine saw
            batch = batch.union(pixel_values=images.pixels.repeat_interleave(params.n, 0))
        if greedy:
            greedy_out = self.engine.generate(prompt_ids, replace(params, n=1, temperature=0.0), seed, images)
            batch = batch.union(
                baseline_responses=greedy_out.responses.repeat_interleave(params.n, 0),
                baseline_mask=greedy_out.response_mask.repeat_interleave(params.n, 0),
            )
        return batch

    def sample_partial(
        self, prompt_ids: list[list[int]], params: SamplingParams, seed: int
    ) -> tuple[RolloutOutput, torch.Tensor]:
        """The rollout, stopped after any decode step at which an update is announced: the engine is handed
        to the update, then the unfinished samples continue from their tokens so far with the new weights
        (again and again, if more updates come). Returns it and which samples were continued (B*n,)."""
        interrupt = self.update_waiting.is_set
        out = self.engine.generate(prompt_ids, params, seed, interrupt=interrupt)
        continued, round_ = torch.zeros(len(out.responses), dtype=torch.bool), 0
        while out.unfinished is not None and out.unfinished.any():
            rows = out.unfinished.nonzero().squeeze(-1)
            continued[rows] = True
            self.engine_lock.release()  # the update goes now
            try:
                while self.update_waiting.is_set():
                    time.sleep(0.001)
            finally:
                self.engine_lock.acquire()
            round_ += 1
            # the tokens each sample has (an unfinished one has no stop token: its mask covers them all); the
            # hf engine cuts every sample at one length, a continuously batching one (vllm) may not
            so_far = out.response_mask.sum(-1)
            for length in so_far[rows].unique().tolist():  # one continuation per length: its own budget
                group = rows[so_far[rows] == length]
                more = self.engine.generate(
                    [prompt_ids[r // params.n] + out.responses[r, :length].tolist() for r in group.tolist()],
                    replace(params, n=1, max_new_tokens=params.max_new_tokens - length),
                    derive_seed(seed, "continue", round_, length),
                    interrupt=interrupt,
                )
                out = continue_samples(out, group, more, self.tokenizer.pad_token_id)
        return out, continued

    def counted(self, counts: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
        """The `size` episodes' counters, with every one the played environments declare (zeros where none
        counted it): the same tensors in every batch, whichever episodes it holds."""
        declared = [c for name in self.multi_turn.played for c in COUNTERS.get(name, ())]
        return {c: counts.get(c, torch.zeros(size)) for c in dict.fromkeys([*declared, *counts])}

    def env_of(self, row: dict) -> str:
        """The environment a row plays (multi_turn.envs by its data_source, else multi_turn.env)."""
        return self.multi_turn.env_of(str(row.get("data_source", "")))

    def encode(
        self, rows: list[dict], given: list[dict] | None = None
    ) -> tuple[list[list[int]], PromptImages | None]:
        """Each row's prompt ids (a VLM's `<image>` token expanded to the image's tokens) and, for a VLM, the
        rows' images; None for a text-only policy. The tools' schemas are in the prompts of the rows that play
        the tools environment alone (`given`: the rows as the data gave them, before an environment's first
        messages replaced their prompts)."""
        schemas = [t.schema for t in self.tools.values()] or None
        tools = [schemas if self.tools and self.env_of(row) == "tools" else None for row in given or rows]
        prompt_ids = [
            encode_prompt(self.tokenizer, r["prompt"], self.prompts, t) for r, t in zip(rows, tools)
        ]
        if self.images is None:
            return prompt_ids, None
        return [self.images.expand(p) for p in prompt_ids], self.images.prompt_images(rows)

    def decode(self, batch: Batch) -> list[str]:
        from components.rollout.batching import decode_responses

        return decode_responses(self.tokenizer, batch)
