"""Routing replay: a mixture-of-experts forward that sends chosen tokens to given experts.

The inference engine and the trainer can route a token to different experts (their numerics differ, or
the weights moved between sampling and training), and a token routed differently has a different
probability: the importance ratio of a mixture is noisy for reasons that have nothing to do with the
policy. Replaying the engine's routing in the trainer's forward removes that part. The router still
computes its scores, and a replayed token's gate weights are the trainer's own softmax scores of the
replayed experts (renormalised as usual), so gradients flow into the router as they would had it chosen
those experts itself.

Every MoE layer's router is a ReplayRouter (models.py builds them so); without replayed experts it is
torchtitan's TokenChoiceTopKRouter exactly. `replay_routing(model, experts)` hands each layer its slice of
`experts` [batch, seq, layers, top_k] (int64; -1 where the router chooses freely) for the forwards (and
the backward's recomputations) inside the block.
"""

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import torch
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from meshy.dataplane import SchemaError

FREE = -1  # a position whose experts the router chooses itself


class ReplayRouter(TokenChoiceTopKRouter):
    """torchtitan's token-choice top-k router, which uses the experts it is given where it is given some."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.replayed: torch.Tensor | None = None  # [batch, seq, top_k] int64, FREE where not replayed

    def forward(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        if self.replayed is None:
            return topk_scores_BLK, topk_expert_ids_BLK, scores_BLE
        replayed = self.replayed
        if tuple(replayed.shape) != (*x_BLD.shape[:2], self.top_k):
            raise SchemaError(
                f"replayed experts: expected shape {(*x_BLD.shape[:2], self.top_k)} for this layer's input, "
                f"got {tuple(replayed.shape)}"
            )
        # The free positions get their own choice back, so their scores are computed exactly as torchtitan's.
        topk_expert_ids_BLK = torch.where(replayed >= 0, replayed, topk_expert_ids_BLK)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=topk_expert_ids_BLK)
        if self.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_BLK * self.route_scale, topk_expert_ids_BLK, scores_BLE


def replay_router_config(config: TokenChoiceTopKRouter.Config) -> ReplayRouter.Config:
    """The same router settings, built as a ReplayRouter."""
    return ReplayRouter.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def replay_routers(model: torch.nn.Module) -> list[ReplayRouter]:
    """The model's routers in layer order (empty for a dense model)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, ReplayRouter):
            layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if layer is None:
                raise SchemaError(f"routing replay: router {name} is not inside a numbered layer")
            found[int(layer.group(1))] = module
    return [found[i] for i in sorted(found)]


def routing_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(MoE layers, experts per token, experts) of a mixture; a SchemaError for a dense model."""
    routers = replay_routers(model)
    if not routers:
        raise SchemaError("routing replay: the model has no mixture-of-experts layers")
    return len(routers), routers[0].top_k, routers[0].num_experts


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the model's forwards (over inputs [batch, seq]) route position (b, t) of layer l
    to experts[b, t, l] wherever those are not FREE. experts: [batch, seq, layers, top_k] int64 on the
    model's device, or None (nothing replayed)."""
    if experts is None:
        yield
        return
    layers, top_k, _ = routing_shape(model)
    if experts.ndim != 4 or tuple(experts.shape[2:]) != (layers, top_k) or experts.dtype != torch.int64:
        raise SchemaError(
            f"replayed experts: expected int64 [batch, seq, {layers}, {top_k}], "
            f"got {str(experts.dtype).removeprefix('torch.')} {tuple(experts.shape)}"
        )
    routers = replay_routers(model)
    for layer, router in enumerate(routers):
        router.replayed = experts[:, :, layer]
    try:
        yield
    finally:
        for router in routers:
            router.replayed = None
