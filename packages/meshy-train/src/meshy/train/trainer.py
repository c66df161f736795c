"""One optimizer step of the policy: per-token logprobs, the configured loss parts, clipping, AdamW.

A step's loss is normalised by a count all-reduced over data-parallel ranks (trained tokens, or
sequences), so FSDP's summed gradients equal those of the whole global batch on one process, and the
metrics of its loss and loss parts (pg_loss, kl, distill_kl, the entropy bonus) are global means. A step
whose loss or gradient norm is not finite on any rank is skipped on every rank and counted; a step with
nothing to learn from on any rank is not taken at all (`stepped` 0): no token to train (every row
dropped), or a policy-gradient step whose every advantage is 0 (every group's rewards equal) with no KL or
distillation term, where only the entropy bonus would act, unless the caller asks to `explore` (see
TrainingService: the version scored below the run's best, so the policy lost what it had found). A batch
with routed_experts replays that routing in every forward of the step (and the backward's
recomputations under activation checkpointing).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import clip_grad_norm_

from meshy.dataplane import SchemaError
from meshy.train.collectives import reduce_over_ranks
from meshy.train.logprobs import full_log_probs, picked_logprobs, response_logits, spread
from meshy.train.losses import (
    aggregate,
    entropy_from_log_probs,
    importance_weights,
    kl_to_reference,
    ppo_clip_loss,
    topk_forward_kl,
)
from meshy.train.routing_replay import replay_routing
from meshy.train.shared_prompts import SharedPrompts
from meshy.train.training_config import LossConfig, OptimConfig


@dataclass
class PolicyBatch:
    """One rank's minibatch. Positions t index the label tokens[:, t + 1]; mask marks response tokens."""

    tokens: torch.Tensor  # [B, T] int64, prompt + response, right-padded
    mask: torch.Tensor  # [B, T-1] float
    advantages: torch.Tensor  # [B] or [B, T-1]
    rollout_logprobs: torch.Tensor | None = None  # [B, T-1]
    old_logprobs: torch.Tensor | None = None  # [B, T-1]; None: this step is on-policy for the trainer
    ref_logprobs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None  # [B, T-1, k]
    teacher_topk_logprobs: torch.Tensor | None = None
    # [B, T-1, layers, top_k] int64: the experts position t (input token t) uses in each MoE layer, -1
    # where the router chooses freely (meshy.train.routing_replay); None: no replay.
    routed_experts: torch.Tensor | None = None
    # The rows packed by shared prompt for the forward (meshy.train.shared_prompts); None: row by row.
    packed: SharedPrompts | None = None


def adamw(model: torch.nn.Module, optim: OptimConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters (the adapters only, under LoRA: meshy.train.lora) and its
    linear warm-up schedule (optim.warmup_steps)."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    warmup = optim.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def _expert_parallel(param: torch.Tensor) -> bool:
    """Sharded over an expert-parallel mesh: its norm is reduced over other ranks than the dense ones'."""
    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def finite_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss: torch.Tensor,
    max_grad_norm: float,
) -> tuple[float, bool]:
    """After backward: clip the gradients, then step (optimizer and schedule) only if the loss and the
    gradient norm are finite on every rank, so all ranks skip together; the gradients are zeroed either
    way. Returns the gradient norm and whether it stepped."""
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = clip_grad_norm_(params, max_grad_norm, ep_enabled=any(map(_expert_parallel, params)))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    finite = torch.tensor(float(math.isfinite(loss.item()) and math.isfinite(grad_norm.item())), device=loss.device)
    stepped = reduce_over_ranks(finite, dist.ReduceOp.MIN).item() == 1.0
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm), stepped


class PolicyTrainer:
    def __init__(self, model: torch.nn.Module, optim: OptimConfig, loss: LossConfig):
        self.model = model
        self.loss = loss
        self.optim = optim
        self.optimizer, self.scheduler = adamw(model, optim)
        self.steps = 0
        self.skipped_nonfinite = 0

    @torch.no_grad()
    def logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """The current policy's logprobs of a batch's trained tokens (the "old" policy when a version takes
        several steps), 0 at positions outside its mask."""
        positions = batch.mask.bool()
        with replay_routing(self.model, batch.routed_experts):
            logits = response_logits(self.model, batch.tokens, positions, batch.packed)
        labels = batch.tokens[:, 1:][positions]
        return spread(picked_logprobs(full_log_probs(logits, self.loss.temperature), labels), positions)

    def step(self, batch: PolicyBatch, explore: bool = False) -> dict[str, float]:
        """One optimizer step. explore: when no advantage is nonzero, still step on the entropy bonus (if any)."""
        self._check(batch)
        with replay_routing(self.model, batch.routed_experts):
            return self._step(batch, explore)

    def _step(self, batch: PolicyBatch, explore: bool) -> dict[str, float]:
        cfg = self.loss
        device = batch.tokens.device
        local_tokens = batch.mask.sum()
        advantages = batch.advantages if batch.advantages.ndim == 2 else batch.advantages.unsqueeze(1)
        sequences = (batch.mask.sum(dim=1) > 0).sum()
        signal = (batch.mask.bool() & (advantages != 0)).sum()
        counts = torch.stack([local_tokens.float(), sequences.float(), signal.float()])
        global_tokens, global_sequences, global_signal = reduce_over_ranks(counts.to(device)).tolist()
        denominator = max(global_tokens if cfg.aggregation == "token_mean" else global_sequences, 1.0)
        # Nothing to learn from on any rank: no token, or (a policy-gradient step with no advantage, say
        # every group got every answer right) only the entropy bonus, which steers alone only to explore.
        other_terms = not cfg.pg_coef or cfg.kl_coef or cfg.distill_coef or (explore and cfg.entropy_coef)
        learns = global_tokens > 0 and (global_signal > 0 or bool(other_terms))

        # Logits only where a token is trained ([N, V] for the N positions of the mask), spread back to
        # [B, T-1] per-token tensors (0 elsewhere), which the losses mask.
        positions = batch.mask.bool()
        logits = response_logits(self.model, batch.tokens, positions, batch.packed)
        if cfg.temperature != 1.0:
            logits = logits / cfg.temperature
        log_probs = full_log_probs(logits)
        logprobs = spread(picked_logprobs(log_probs, batch.tokens[:, 1:][positions]), positions)
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        metrics: dict[str, float] = {"tokens": float(local_tokens), "global_tokens": global_tokens}
        parts: dict[str, torch.Tensor] = {}  # this rank's shares of the loss parts' global means
        token_loss = torch.zeros_like(logprobs)
        if cfg.pg_coef:
            pg, stats = ppo_clip_loss(
                logprobs,
                old,
                batch.advantages.to(logprobs.dtype),
                batch.mask,
                cfg.clip_low,
                cfg.clip_high,
                cfg.dual_clip,
            )
            metrics.update(stats)
            if cfg.tis != "none":
                if batch.rollout_logprobs is None:
                    raise SchemaError("PolicyBatch.rollout_logprobs: required when LossConfig.tis is not 'none'")
                weights, tis_stats = importance_weights(
                    old, batch.rollout_logprobs, batch.mask, cfg.tis_low, cfg.tis_high, cfg.tis
                )
                pg = pg * weights
                metrics.update(tis_stats)
            parts["pg_loss"] = aggregate(pg.detach(), batch.mask, cfg.aggregation, denominator)
            token_loss = token_loss + cfg.pg_coef * pg
        if cfg.kl_coef:
            if batch.ref_logprobs is None:
                raise SchemaError("PolicyBatch.ref_logprobs: required when LossConfig.kl_coef is set")
            kl = kl_to_reference(logprobs, batch.ref_logprobs)
            parts["kl"] = aggregate(kl.detach(), batch.mask, cfg.aggregation, denominator)
            token_loss = token_loss + cfg.kl_coef * kl
        if cfg.entropy_coef:
            entropy = spread(entropy_from_log_probs(log_probs.unsqueeze(0))[0], positions)
            parts["entropy"] = aggregate(entropy.detach(), batch.mask, cfg.aggregation, denominator)
            token_loss = token_loss - cfg.entropy_coef * entropy
        else:
            metrics["entropy"] = self._entropy_metric(log_probs)
        if cfg.distill_coef:
            if batch.teacher_topk_ids is None or batch.teacher_topk_logprobs is None:
                raise SchemaError(
                    "PolicyBatch.teacher_topk_ids/_logprobs: required when LossConfig.distill_coef is set"
                )
            distill = topk_forward_kl(
                logits.unsqueeze(0),
                batch.teacher_topk_ids[positions].unsqueeze(0),
                batch.teacher_topk_logprobs[positions].unsqueeze(0),
            )
            distill = spread(distill[0], positions)
            parts["distill_kl"] = aggregate(distill.detach(), batch.mask, cfg.aggregation, denominator)
            token_loss = token_loss + cfg.distill_coef * distill

        loss = aggregate(token_loss, batch.mask, cfg.aggregation, denominator)
        loss.backward()
        if learns:
            grad_norm, stepped = finite_step(self.model, self.optimizer, self.scheduler, loss, self.optim.max_grad_norm)
            self.steps += stepped
            self.skipped_nonfinite += not stepped
        else:  # AdamW would still move every weight along its momentum, and its full-size step along the
            # entropy bonus's gradient alone flattens a policy that has learned (seen: 1.0 to the uniform policy)
            self.optimizer.zero_grad(set_to_none=True)
            grad_norm, stepped = 0.0, False
        # One all-reduce turns every rank's shares into the global means, the loss's and its parts'.
        totals = reduce_over_ranks(torch.stack([loss.detach(), *parts.values()]).float()).tolist()
        metrics.update(zip(parts, totals[1:], strict=True))
        metrics.update(
            loss=totals[0],
            grad_norm=grad_norm,
            stepped=float(stepped),
            lr=self.scheduler.get_last_lr()[0],
            skipped_nonfinite=float(self.skipped_nonfinite),
        )
        return metrics

    def _entropy_metric(self, log_probs: torch.Tensor) -> float:
        """Mean entropy per trained token (log_probs: [N, V], one row per trained token), over at most
        `entropy_metric_tokens` of them per rank (evenly strided): as a metric it needs no more, and on
        small models a full pass costs as much as a layer."""
        with torch.no_grad():
            device = log_probs.device
            limit = self.loss.entropy_metric_tokens
            rows = torch.arange(len(log_probs), device=device)
            if limit and len(rows) > limit:
                rows = torch.linspace(0, len(rows) - 1, limit, device=device).long()
            picked = log_probs[rows].unsqueeze(0)
            count = torch.tensor(float(len(rows)), device=device)
            totals = torch.stack([entropy_from_log_probs(picked).sum(), count])
            entropy_sum, count = reduce_over_ranks(totals).tolist()
        return entropy_sum / max(count, 1.0)

    @staticmethod
    def _check(batch: PolicyBatch) -> None:
        b, t = batch.tokens.shape
        if batch.tokens.dtype != torch.int64 or t < 2:
            raise SchemaError(f"PolicyBatch.tokens: expected int64 [B, T>=2], got {batch.tokens.dtype} {(b, t)}")
        for name in ("mask", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            value = getattr(batch, name)
            if value is not None and tuple(value.shape) != (b, t - 1):
                raise SchemaError(f"PolicyBatch.{name}: expected shape {(b, t - 1)}, got {tuple(value.shape)}")
        if batch.packed is not None and (batch.routed_experts is not None or batch.packed.index.shape != (b, t - 1)):
            raise SchemaError(
                f"PolicyBatch.packed: expected an index of shape {(b, t - 1)} and no routed_experts (routing is "
                f"replayed row by row), got {tuple(batch.packed.index.shape)}"
            )
        routed = batch.routed_experts
        if routed is not None and tuple(routed.shape[:2]) != (b, t - 1):
            raise SchemaError(
                f"PolicyBatch.routed_experts: expected shape {(b, t - 1)} + (layers, top_k), got {tuple(routed.shape)}"
            )
