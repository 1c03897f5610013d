"""The config keys each pipeline stage reads, declared once.

A stage's Prefect cache key (tasks/caching.py), the resume fingerprint (the train stage's keys but its
neutral ones) and dvc.yaml's `params` (checked by tests/test_stages.py) all come from these declarations. An
entry is a dotted key or a whole section (`algorithm`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageKeys:
    reads: tuple[str, ...]  # a change re-runs the stage
    neutral: tuple[str, ...] = ()  # read, but a checkpoint made under other values still resumes (train)

    def covers(self, key: str) -> bool:
        """Whether the dotted `key` is one of `reads` or inside one of its sections."""
        return any(key == r or key.startswith(r + ".") for r in self.reads)

    def shapes(self, key: str) -> bool:
        """Whether `key` changes what the stage computes: read, and not neutral."""
        return self.covers(key) and not any(key == n or key.startswith(n + ".") for n in self.neutral)


PROMPT_KEYS = ("data.apply_chat_template", "data.allow_unk", "data.max_prompt_len")

# what decides how many tokens an image of a prompt takes (a VLM's; multimodal SFT composes it from these)
IMAGE_TOKEN_KEYS = (
    "actor.model.type",
    "actor.model.text_model",
    "actor.model.vision_model",
    "actor.model.fusion_method",
    "actor.model.vision_token_ratio",
    "actor.model.max_seq_len",
    "data.image_processor",
)

STAGES: dict[str, StageKeys] = {
    "prepare": StageKeys(
        (
            "data.num_train",
            "data.num_eval",
            "data.max_operand",
            "data.operations",
            "data.gsm8k_path",
            "data.gsm8k_test_path",
            "data.task",
            "data.reasoning_gym",
            "data.tool_sft_fraction",
            "data.max_count",
            "data.llava_path",
            "data.llava_image_folder",
            "data.image_processor.size",
            "multi_turn.game",
            "multi_turn.max_turns",
            "trainer.seed",
        )
    ),
    # the tokenizer prompts are checked with: sft.base_model's, the policy's when it is not SFT's output, or the
    # tiny one (with tool tokens for data.task=arith_tool or multi-turn runs)
    "clean": StageKeys(
        (
            *PROMPT_KEYS,
            # the scorer each data_source gets: a ground truth it can never match is quarantined
            "reward_model.sources",
            "reward_model.default_scorer",
            "custom_reward_function.path",
            "data.task",
            "sft.base_model",
            "sft.output_dir",
            "actor.model.path",
            "multi_turn.enable",
            *IMAGE_TOKEN_KEYS,
        )
    ),
    "sft": StageKeys(
        (
            "sft",
            *PROMPT_KEYS,
            "data.task",
            "multi_turn.enable",
            "multi_turn.max_tool_response_chars",
            "trainer.seed",
            *IMAGE_TOKEN_KEYS,
            "actor.model.freeze_vision_model",
            "actor.model.vision_lr_ratio",
        )
    ),
    "train": StageKeys(
        (
            "algorithm",
            "actor",
            "critic",
            "engine",
            "reward_model",
            "reward",
            "custom_reward_function",
            "sandbox",
            "multi_turn",
            "distill",
            "data.batch_size",
            "data.shuffle",
            *PROMPT_KEYS,
            "trainer",
            "memory_optim",
            "mixed_precision",
        ),
        neutral=(
            "trainer.iterations",
            "trainer.resume_mode",
            "trainer.resume_accept_mismatch",
            "trainer.when_finished",
            "trainer.progress",
            "trainer.log_system_metrics",
            "trainer.system_metrics_interval_s",
            "trainer.save_interval",
            "trainer.test_interval",
            "trainer.eval_k",
            "trainer.eval_size",
            "trainer.experiment_name",
            "trainer.max_checkpoints_to_keep",
            "trainer.num_threads",
            "trainer.save_optimizer",
            "trainer.checkpoint_format",
            "trainer.stage_timeout_s",
            "trainer.connect_timeout_s",
            "trainer.ray_start_timeout_s",
            "trainer.max_worker_rebuilds",
            "trainer.output_dir",
            "trainer.run_dir",
            # how the update is spread over workers: the same step (within rounding) and a checkpoint format that
            # does not depend on it, so a group rebuilt smaller resumes the run
            "trainer.num_workers",
            "trainer.backend",
            "actor.tensor_model_parallel_size",
            "actor.sequence_parallel",
            "actor.pipeline_model_parallel_size",
            "actor.pipeline_microbatches",
            "actor.pipeline_schedule",
            "trainer.strategy",
            "trainer.data_parallel_size",
            "trainer.zero_stage",
            "trainer.worker_resources",
            "trainer.rollout_resources",
            "trainer.min_workers",
            "trainer.grad_compression",
            "trainer.compression_fp16_below_gbps",
            "trainer.compression_powersgd_below_gbps",
            "trainer.simulated_bandwidth_gbps",
        ),
    ),
    "evaluate": StageKeys(
        (
            "engine",
            "actor.model",
            "reward_model",
            "reward",
            "custom_reward_function",
            "sandbox",
            "multi_turn",
            *PROMPT_KEYS,
            "trainer.seed",
            "trainer.eval_k",
            "trainer.eval_size",
        )
    ),
}
