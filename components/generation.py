"""Completions of prompts from a local model directory, without Ray or tracking: `reinforge generate`, and
the logged MLflow model's `predict` (components/tracking/policy_model.py)."""

from __future__ import annotations

from components.data.prompts import check_fits, prompt_form
from components.settings import PromptSettings, SamplingParams


class Completer:
    """A model directory (or a training output directory: its last finished run's final model) loaded once,
    completing prompts: plain strings, or lists of chat messages."""

    def __init__(
        self,
        model_path: str,
        settings: PromptSettings = PromptSettings(),
        key: str = "--model_path",
        trust_remote_code: bool = False,
    ):
        from components.rollout.worker import RolloutWorker
        from components.settings import EngineOptions
        from components.tracking import runs

        self.settings = settings
        options = EngineOptions(dtype="float32", trust_remote_code=trust_remote_code)
        path = str(runs.model_dir(model_path))
        self.worker = RolloutWorker(path, options=options, key=key, prompts=settings)

    def __call__(
        self, prompts: list, n: int = 1, temperature: float = 0.0, max_new_tokens: int = 16, seed: int = 0
    ) -> list[dict]:
        """n completions of each prompt, in order: [{prompt, completion}], prompt i's at i*n .. i*n+n-1."""
        for prompt in prompts:
            check_fits(self.worker.tokenizer, prompt_form(prompt), self.settings, "the prompts given")
        rows = [
            {"prompt": p, "reward_model": {"ground_truth": ""}, "data_source": "cli", "extra_info": {}}
            for p in prompts
        ]
        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens)
        texts = self.worker.decode(self.worker.generate(rows, params, seed, iteration=0))
        return [{"prompt": prompts[i // n], "completion": texts[i]} for i in range(len(texts))]
