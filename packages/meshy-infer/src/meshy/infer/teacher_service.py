"""The teacher service: scores responses with a fixed teacher model for online policy distillation.

For each row whose prompt_ids and response_ids are ready it writes the teacher's top-k token ids and
log-probabilities at every response position ([L, k] each); a row it cannot score gets [0, k] columns
(meshy.infer.response_scoring).
"""

from dataclasses import dataclass

import torch

from meshy.dataplane import HOST, SchemaError
from meshy.dataplane import columns as cols
from meshy.infer.engine import Scores
from meshy.infer.response_scoring import ScoringConfig, ScoringService


@dataclass(frozen=True)
class TeacherServiceConfig(ScoringConfig):
    task: str = cols.TEACHER_TASK.name
    top_k: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k < 1:
            raise SchemaError(f"TeacherServiceConfig.top_k: expected >= 1, got {self.top_k}")


class TeacherService(ScoringService):
    declared = cols.TEACHER_TASK
    config: TeacherServiceConfig

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def row_columns(self, scores: Scores) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(scores.topk_ids, dtype=torch.int64, device=HOST)
        return ids, torch.tensor(scores.topk_logprobs, dtype=torch.float32, device=HOST)

    def empty_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.config.top_k
        return torch.zeros(0, k, dtype=torch.int64, device=HOST), torch.zeros(0, k, device=HOST)
