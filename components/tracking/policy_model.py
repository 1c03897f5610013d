"""The trained policy as an MLflow pyfunc model: prompts in, completions out.

MLflow stores this file beside the model's weights ("models from code"), so loading the model runs this
file and unpickles nothing. It needs reinforge importable where it loads (serve with
`mlflow models serve --env-manager local` from the project's environment):

    model = mlflow.pyfunc.load_model("models:/reinforge-arith@champion")
    model.predict(pd.DataFrame({"prompt": ["12+34="]}), params={"max_new_tokens": 8})
"""

import pandas as pd
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

WEIGHTS = "model"  # the artifact holding the Hugging Face model directory


class Policy(PythonModel):
    """predict: a DataFrame with a `prompt` column (or a list of prompts, or {"prompt": [...]}) -> a
    DataFrame with one `completion` per prompt. Params: max_new_tokens, temperature (0 = greedy), seed."""

    def load_context(self, context) -> None:
        from components.generation import Completer
        from components.settings import PromptSettings

        config = context.model_config or {}
        settings = PromptSettings(config.get("apply_chat_template"))
        trust = bool(config.get("trust_remote_code", False))  # as the run that trained it was told
        self.complete = Completer(context.artifacts[WEIGHTS], settings, "the logged model", trust)

    # the DataFrame hint is what pyfunc hands over (the signature's prompt column); MLflow infers no schema
    # from it, so the explicit signature logged with the model stays the one served
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        params = params or {}
        out = self.complete(
            prompts_of(model_input),
            temperature=float(params.get("temperature", 0.0)),
            max_new_tokens=int(params.get("max_new_tokens", 16)),
            seed=int(params.get("seed", 0)),
        )
        return pd.DataFrame({"completion": [o["completion"] for o in out]})


def prompts_of(model_input) -> list:
    """The prompts of what pyfunc's predict was given: a DataFrame's `prompt` column, {"prompt": [...]}, a
    list, or one string."""
    if hasattr(model_input, "columns"):
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(p) for p in model_input[column]]
    if isinstance(model_input, dict):
        value = model_input.get("prompt", [])
        return [value] if isinstance(value, str) else list(value)
    return [model_input] if isinstance(model_input, str) else list(model_input)


set_model(Policy())
