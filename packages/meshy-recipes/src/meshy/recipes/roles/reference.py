"""The reference role: the frozen initial policy (meshy.recipes.roles.reference_weights) scores every response
into ref_logprobs, for the KL term of the loss (algorithm.loss.kl_coef), in the scoring roles' shape
(meshy.recipes.roles.scoring_role), like the teacher role."""

import asyncio
from typing import Any

from meshy.dataplane.weights import Published
from meshy.infer.reference_service import ReferenceService, ReferenceServiceConfig
from meshy.recipes.roles.context import RecordKind
from meshy.recipes.roles.reference_weights import wait_for_reference
from meshy.recipes.roles.scoring_role import ScoringRole


class ReferenceRole(ScoringRole[Published]):
    service_type = ReferenceService
    config_type = ReferenceServiceConfig
    kind = RecordKind.REFERENCE

    async def weights(self) -> Published | None:
        return await asyncio.to_thread(wait_for_reference, self.ctx)

    def summary(self, weights: Published) -> dict[str, Any]:
        return {"version": weights.version, "device": self.ctx.slot.device}
