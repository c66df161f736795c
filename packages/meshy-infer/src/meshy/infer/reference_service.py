"""The reference service: scores responses with the frozen reference policy, for KL to it in the loss.

For each row whose prompt_ids and response_ids are ready it writes ref_logprobs: the reference's
log-probability of every response token (float32 [L], aligned like rollout_logprobs); a row it cannot
score gets a [0] column (meshy.infer.response_scoring), which the trainer drops with a reason.
"""

from dataclasses import dataclass

import torch

from meshy.dataplane import HOST
from meshy.dataplane import columns as cols
from meshy.infer.engine import Scores
from meshy.infer.response_scoring import ScoringConfig, ScoringService


@dataclass(frozen=True)
class ReferenceServiceConfig(ScoringConfig):
    task: str = cols.REFERENCE_TASK.name


class ReferenceService(ScoringService):
    declared = cols.REFERENCE_TASK

    def row_columns(self, scores: Scores) -> tuple[torch.Tensor]:
        return (torch.tensor(scores.token_logprobs, dtype=torch.float32, device=HOST),)

    def empty_columns(self) -> tuple[torch.Tensor]:
        return (torch.zeros(0, dtype=torch.float32, device=HOST),)
