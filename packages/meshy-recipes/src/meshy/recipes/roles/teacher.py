"""The teacher role (online policy distillation): a fixed teacher model (model.teacher) scores every
response, its top-k tokens at each position (algorithm.teacher_topk), in the scoring roles' shape
(meshy.recipes.roles.scoring_role), like the reference role."""

from pathlib import Path
from typing import Any

from meshy.infer.teacher_service import TeacherService, TeacherServiceConfig
from meshy.recipes.roles.context import RecordKind
from meshy.recipes.roles.scoring_role import ScoringRole
from meshy.recipes.weights.pretrained import resolve


class TeacherRole(ScoringRole[Path]):
    service_type = TeacherService
    config_type = TeacherServiceConfig
    kind = RecordKind.TEACHER

    async def weights(self) -> Path:
        return resolve(self.ctx.recipe.model.teacher)

    def options(self) -> dict[str, Any]:
        return {"top_k": self.ctx.recipe.algorithm.teacher_topk}
