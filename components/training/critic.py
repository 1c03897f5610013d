"""The critic: a value model (the policy's transformer backbone plus a linear value head) and its update
with the clipped value loss, for PPO with GAE."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from components.algorithms.losses import AggParams, value_loss
from components.batch import Batch
from components.models.loading import image_token_id, load_model
from components.models.lora import apply_lora
from components.settings import LoopSettings, LoraSettings
from components.training.distributed import Comm
from components.training.logprobs import response_attention, sequence_inputs
from components.training.loop import minibatch_update, row_chunks

if TYPE_CHECKING:  # transformers' modeling code: imported where a model is built, not here
    from transformers import PreTrainedModel


class ValueModel(torch.nn.Module):
    """V(prefix) for every response position: head(h_{P-1+t}) is the value of the state before response
    token t, read off the same positions that predict the tokens (verl's values[:, -R-1:-1]).

    A VLM keeps its whole module (its fusion puts the image in the sequence) and the head reads the last
    hidden states it returns; a text model keeps only its transformer, without the LM head."""

    def __init__(self, causal_lm: PreTrainedModel):
        super().__init__()
        self.vision = image_token_id(causal_lm) is not None
        self.backbone = causal_lm if self.vision else causal_lm.base_model
        config = getattr(causal_lm.config, "text_config", None) or causal_lm.config
        self.head = torch.nn.Linear(config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # V = 0 at the start: returns are learnt from the first update
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, prompts, prompt_mask, responses, response_mask, pixel_values=None) -> torch.Tensor:
        """(N, P) left-padded prompts, (N, R) responses (and a VLM's images (N, C, H, W)) -> values (N, R)
        float32, 0 on padding."""
        ids, mask, positions = sequence_inputs(prompts, prompt_mask, responses, response_mask)
        P, R = prompts.shape[1], responses.shape[1]
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": False}
        if self.vision:
            out = self.backbone(
                **inputs, pixel_values=pixel_values, output_hidden_states=True, logits_to_keep=1
            )
            hidden = out.hidden_states[-1]  # (N, P+R, H), after the final norm
        else:
            hidden = self.backbone(**inputs).last_hidden_state  # (N, P+R, H)
        values = self.head(hidden[:, P - 1 : P + R - 1, :]).squeeze(-1).float()  # (N, R)
        return values * response_mask


def build_value_model(
    path: str, dtype: str, attention: str, key: str, lora: LoraSettings, trust_remote_code: bool = False
) -> ValueModel:
    """The critic: the causal LM at `path` (`key` names it in errors) as a backbone, with LoRA adapters
    injected into its layers when `lora` is enabled (its weights then frozen: the adapters and the value head
    train, and only they get optimizer state)."""
    backbone = load_model(path, dtype, attention, key, trust_remote_code=trust_remote_code)
    if lora.enabled:
        apply_lora(backbone, lora, path)  # in place: the backbone's own modules get the adapters
    return ValueModel(backbone)


class CriticTrainer:
    """Owns the value model and its optimizer. `values(batch)` before the advantages, `update(batch)` after."""

    def __init__(
        self,
        model: ValueModel,
        optimizer,
        scheduler,
        loop: LoopSettings,
        cliprange: float,
        agg_mode: str = "token-mean",
        comm: Comm | None = None,
    ):
        self.model, self.optimizer, self.scheduler, self.comm = model, optimizer, scheduler, comm or Comm()
        self.loop, self.cliprange, self.agg_mode = loop, cliprange, agg_mode
        self.steps = 0

    def _forward(self, b: Batch) -> torch.Tensor:
        t = b.tensors
        return self.model(
            t["prompts"], t["prompt_mask"], t["responses"], response_attention(t), t.get("pixel_values")
        )

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self._forward(p) for p in row_chunks(batch, self.loop.micro_batch_size)])

    def _micro_loss(self, mb: Batch, agg: AggParams):
        t = mb.tensors
        loss, metrics = value_loss(
            self._forward(mb),
            t["values"],
            t["returns"],
            t["response_mask"].float(),
            self.cliprange,
            self.agg_mode,
            agg,
        )
        return loss, {**metrics, "critic/vf_loss": loss.detach()}

    def update(self, batch: Batch) -> dict[str, float]:
        """Fit V to `returns` (needs values from before the update, returns, response_mask)."""
        self.model.train()
        metrics = minibatch_update(
            batch,
            self.model,
            self.optimizer,
            self.scheduler,
            self.loop,
            self.steps,
            self._micro_loss,
            "critic",
            self.comm,
        )
        self.steps += 1
        self.model.eval()
        return metrics
