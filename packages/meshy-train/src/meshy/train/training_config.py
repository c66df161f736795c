"""The training side's configs, as a recipe declares them: plain dataclasses checked when built, importable
without torch or torchtitan (a recipe is validated by processes that never train)."""

import math
from dataclasses import dataclass
from typing import Literal

from meshy.dataplane.errors import SchemaError
from meshy.dataplane.fields import check_fields


@dataclass(frozen=True)
class ParallelConfig:
    """How the training role splits its model. Every training rank trains rows of its own, on whole sequences and
    whole logits: FSDP (dp_shard, dp_replicate) and expert parallelism (ep) split the model that way; tensor and
    context parallelism (tp, cp) would need ranks that share rows and split their logits or sequences, and are
    refused."""

    dp_shard: int = -1
    """FSDP sharding degree (-1: every rank left after the others)."""
    dp_replicate: int = 1
    """Data-parallel replication degree (>= 1)."""
    tp: int = 1
    """Tensor parallelism: 1 only."""
    ep: int = 1
    """Expert-parallel degree, for a mixture-of-experts model (>= 1)."""
    cp: int = 1
    """Context parallelism: 1 only."""
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    """torchtitan's activation checkpointing: "none", "selective" or "full"."""
    compile: bool = False
    """The model through torch.compile (torchtitan's)."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("dp_replicate", "tp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise SchemaError(f"ParallelConfig.{name}: expected a degree >= 1, got {getattr(self, name)}")
        for name, what in (("tp", "tensor"), ("cp", "context")):
            if getattr(self, name) != 1:
                raise SchemaError(
                    f"ParallelConfig.{name}: expected 1, got {getattr(self, name)}: {what} parallelism is not "
                    "supported (each training rank trains rows of its own; split the model with dp_shard and ep)"
                )
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise SchemaError(f"ParallelConfig.dp_shard: expected -1 or a degree >= 1, got {self.dp_shard}")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, with its linear learning-rate warm-up."""

    lr: float = 1e-6
    """Learning rate (finite, > 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's eps (finite, >= 0)."""
    weight_decay: float = 0.0
    """AdamW's weight decay (finite, >= 0)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this total norm (> 0)."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly to lr (0: none)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.lr < math.inf or not self.max_grad_norm > 0 or self.warmup_steps < 0:
            raise SchemaError(f"OptimConfig: lr and max_grad_norm must be > 0 and warmup_steps >= 0, got {self}")
        # AdamW's own checks, here rather than when a role builds its optimizer.
        if not all(0 <= beta < 1 for beta in self.betas):
            raise SchemaError(f"OptimConfig.betas: expected two values in [0, 1), got {self.betas}")
        for name in ("eps", "weight_decay"):
            if not 0 <= getattr(self, name) < math.inf:
                raise SchemaError(f"OptimConfig.{name}: expected a finite value >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class LossConfig:
    """Which loss parts a policy step uses, and their settings."""

    pg_coef: float = 1.0
    """Token-level policy gradient with asymmetric PPO clip [1 - clip_low, 1 + clip_high] (pg_coef and distill_coef
    are not both 0)."""
    clip_low: float = 0.2
    """The clip range below 1 (0 <= clip_low < 1)."""
    clip_high: float = 0.28
    """The clip range above 1 (>= 0)."""
    dual_clip: float = 0.0
    """0 (off) or c > 1: a negative advantage's token loss is capped at -A * c (dual-clip PPO), so a token whose
    ratio ran away cannot dominate a step."""
    aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    """How token losses become one: "token_mean" over the trained tokens of all data-parallel ranks,
    "sequence_mean" over their sequences (each sequence's mean over its trained tokens)."""
    tis: Literal["none", "truncate", "mask"] = "truncate"
    """Truncated importance sampling against the rollout engine's logprobs ("truncate" clamps the per-token ratio
    to [tis_low, tis_high]; "mask" is IcePop: tokens outside get weight 0; "none": off)."""
    tis_low: float = 0.5
    """The importance ratio's lower bound (0 < tis_low <= 1)."""
    tis_high: float = 5.0
    """The importance ratio's upper bound (>= 1)."""
    kl_coef: float = 0.0
    """k3 KL to a reference policy (needs ref_logprobs)."""
    entropy_coef: float = 0.0
    """Entropy bonus."""
    distill_coef: float = 0.0
    """Forward KL to a teacher's top-k (online policy distillation)."""
    temperature: float = 1.0
    """The policy's logits are divided by it before their logprobs (finite, > 0)."""
    entropy_metric_tokens: int = 1024
    """How many trained tokens per rank the entropy metric samples (0: all); the entropy bonus, when entropy_coef
    is set, always uses every token."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("pg_coef", "kl_coef", "distill_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise SchemaError(f"LossConfig.{name}: expected a finite value >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.entropy_coef):
            raise SchemaError(f"LossConfig.entropy_coef: expected a finite value, got {self.entropy_coef}")
        if self.pg_coef == 0 and self.distill_coef == 0:
            raise SchemaError("LossConfig: pg_coef and distill_coef are both 0; the loss would be empty")
        if not 0 < self.temperature < math.inf:
            raise SchemaError(f"LossConfig.temperature: expected a finite value > 0, got {self.temperature}")
        # The ranges ppo_clip_loss and importance_weights check, here rather than at the first step.
        if not 0 <= self.clip_low < 1 or not self.clip_high >= 0:
            raise SchemaError(
                f"LossConfig.clip_low, clip_high: expected 0 <= clip_low < 1 and clip_high >= 0, "
                f"got {self.clip_low}, {self.clip_high}"
            )
        if not (self.dual_clip == 0 or 1 < self.dual_clip < math.inf):
            raise SchemaError(f"LossConfig.dual_clip: expected 0 (off) or a finite value > 1, got {self.dual_clip}")
        if not 0 < self.tis_low <= 1 <= self.tis_high:
            raise SchemaError(
                "LossConfig.tis_low, tis_high: expected 0 < tis_low <= 1 <= tis_high, "
                f"got {self.tis_low}, {self.tis_high}"
            )
        if self.entropy_metric_tokens < 0:
            raise SchemaError(f"LossConfig.entropy_metric_tokens: expected >= 0, got {self.entropy_metric_tokens}")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the policy's projections (meshy.train.lora): the base weights are frozen and only the
    adapters train; each adapted projection computes W x + (alpha / rank) B A dropout(x)."""

    rank: int = 8
    """The adapters' rank r (>= 1): A is r x in, B is out x r."""
    alpha: float = 16.0
    """The adapters' scale is alpha / rank (finite, > 0)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
    """The torchtitan names of the projections to adapt in every layer: the attention's wq, wk, wv, wo and a dense
    MLP's w1, w2, w3 (the model says which it has; a mixture's experts cannot be adapted). Not empty, no repeats."""
    merge_final: bool = False
    """Also keep the final version merged into the base (W + scale B A) as a whole HF model beside the adapter, for
    tools that load a plain model."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rank < 1:
            raise SchemaError(f"LoraConfig.rank: expected >= 1, got {self.rank}")
        if not 0 < self.alpha < math.inf:
            raise SchemaError(f"LoraConfig.alpha: expected a finite value > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise SchemaError(f"LoraConfig.dropout: expected a value in [0, 1), got {self.dropout}")
        if not self.targets or len(set(self.targets)) != len(self.targets) or "" in self.targets:
            raise SchemaError(
                f"LoraConfig.targets: expected one or more distinct projection names, got {self.targets!r}"
            )
