"""The learned critic of PPO in the style of JustRL II, and the service that runs it.

The critic is the policy's backbone with a scalar value head whose weight starts at 0 and bias at the
configured mean reward, so before any training every value is exactly that mean. Values are computed
and trained in float32. The service is a role of its own: it writes the `values` column for new
responses, and trains on the `returns` column (clipped value loss) once the advantage step wrote it.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshy.dataplane import HOST, Batch, Bursts, DataPlaneClient, SchemaError
from meshy.dataplane import columns as cols
from meshy.dataplane.bursts import check_burst_fields
from meshy.dataplane.fields import check_fields
from meshy.train.collectives import reduce_over_ranks
from meshy.train.logprobs import pack_rows
from meshy.train.losses import aggregate, clipped_value_loss
from meshy.train.parallel import shard_beside
from meshy.train.trainer import adamw, finite_step
from meshy.train.training_config import OptimConfig


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int, initial_value: float):
        super().__init__()
        backbone._skip_lm_head = True  # torchtitan's Decoder then returns the final hidden states
        self.backbone = backbone
        device = next(backbone.parameters()).device
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32, device=device)
        with torch.no_grad():
            self.value_head.weight.zero_()
            self.value_head.bias.fill_(initial_value)
        shard_beside(self.value_head, backbone)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Values [B, T-1] in float32: position t values the state before token t + 1 (as logprobs)."""
        hidden = self.backbone(tokens[:, :-1])
        return self.value_head(hidden.float()).squeeze(-1)


@dataclass
class ValueBatch:
    tokens: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1]
    returns: torch.Tensor  # [B, T-1]
    old_values: torch.Tensor  # [B, T-1]


class CriticTrainer:
    def __init__(self, model: ValueModel, optim: OptimConfig, value_clip: float = 0.2):
        if not value_clip > 0:
            raise SchemaError(f"critic value_clip: expected > 0, got {value_clip}")
        self.model = model
        self.optim = optim
        self.value_clip = value_clip
        self.optimizer, self.scheduler = adamw(model, optim)
        self.steps = 0
        self.skipped_nonfinite = 0

    def step(self, batch: ValueBatch) -> dict[str, float]:
        local_tokens = float(batch.mask.sum())
        tokens = reduce_over_ranks(torch.tensor([local_tokens], device=batch.mask.device)).item()
        values = self.model(batch.tokens)
        token_loss, stats = clipped_value_loss(values, batch.old_values, batch.returns, batch.mask, self.value_clip)
        loss = aggregate(token_loss, batch.mask, "token_mean", max(tokens, 1.0))
        loss.backward()
        # Every rank's share of the loss and its token-weighted statistics, summed: the batch's metrics.
        shares = [loss.detach().item()] + [stats[k] * local_tokens if local_tokens else 0.0 for k in stats]
        totals = reduce_over_ranks(torch.tensor(shares, dtype=torch.float64, device=batch.mask.device)).tolist()
        stats = {k: t / tokens if tokens else float("nan") for k, t in zip(stats, totals[1:], strict=True)}
        grad_norm, stepped = finite_step(self.model, self.optimizer, self.scheduler, loss, self.optim.max_grad_norm)
        if stepped:
            self.steps += 1
        else:
            self.skipped_nonfinite += 1
        return {
            "value_loss": totals[0],
            "grad_norm": grad_norm,
            "skipped_nonfinite": float(self.skipped_nonfinite),
            **stats,
        }


@dataclass(frozen=True)
class CriticServiceConfig:
    """policy_mask: rows are multi-turn trajectories; the critic learns only at the policy's tokens (the
    observations between turns have no value target). burst_rows, burst_wait_s: valuing waits for
    burst_rows ready rows (at most rows_per_rank), for up to burst_wait_s after the last ones (a colocated
    critic takes the devices for each forward: meshy.dataplane.bursts); by default it values any."""

    table: str = "rollout"
    values_task: str = cols.CRITIC_VALUES_TASK.name
    train_task: str = cols.CRITIC_TRAIN_TASK.name
    rows_per_rank: int = 8
    groups_per_rank: int = 1
    lease_s: float = 600.0
    batch_timeout_s: float = 60.0
    policy_mask: bool = False
    burst_rows: int = 1
    burst_wait_s: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self)
        check_burst_fields(self, "rows_per_rank")


def _all_have(flag: bool) -> int:
    """How many ranks have work (every rank must join every FSDP forward)."""
    return int(reduce_over_ranks(torch.tensor([float(flag)], device=HOST)).item())


class CriticService:
    """Values rows and trains on their returns, on the device the critic's model is on when the service is
    made. device_turn: what each burst of compute (a valuing forward, a training step) runs inside, once
    some rank has rows for it: a colocated critic's turn on its ring's devices (meshy.recipes.roles.colocation)."""

    def __init__(
        self,
        client: DataPlaneClient,
        trainer: CriticTrainer,
        config: CriticServiceConfig,
        device_turn: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.client = client
        self.trainer = trainer
        self.config = config
        self.device = next(trainer.model.parameters()).device
        self.device_turn = device_turn
        self._bursts = Bursts(config.burst_rows, config.burst_wait_s)

    def write_values(self, timeout: float | None = None) -> int:
        """Value the responses of rows that have none yet; returns the rows this rank wrote."""
        cfg = self.config
        batch = self.client.lease(
            cfg.table,
            cfg.values_task,
            list(cols.CRITIC_VALUES_TASK.reads),
            count=cfg.rows_per_rank,
            min_count=self._bursts.min_count(),
            lease_s=cfg.lease_s,
            timeout=cfg.batch_timeout_s if timeout is None else timeout,
        )
        if batch is not None:
            self._bursts.leased()
        if not _all_have(batch is not None):
            return 0
        with self.device_turn(), torch.no_grad():
            tokens, _, spans = _pad(batch, self.device)
            values = self.trainer.model(tokens)
            per_row = [values[i, span].to(HOST) for i, span in enumerate(spans)]  # off the devices within the turn
        if batch is None:
            return 0
        self.client.add_columns(cfg.table, batch.row_ids, {cols.VALUES: per_row}, ack=batch)
        return len(batch)

    def train_step(self, timeout: float | None = None) -> dict[str, float] | None:
        """One critic step on whole groups whose returns are ready; None if no rank had any."""
        cfg = self.config
        batch = self.client.lease(
            cfg.table,
            cfg.train_task,
            list(cols.CRITIC_TRAIN_TASK.reads) + [cols.POLICY_MASK] * cfg.policy_mask,
            count=cfg.groups_per_rank,
            whole_groups=True,
            lease_s=cfg.lease_s,
            timeout=cfg.batch_timeout_s if timeout is None else timeout,
        )
        if not _all_have(batch is not None):
            return None
        with self.device_turn():
            tokens, mask, spans = _pad(batch, self.device)
            returns, old = torch.zeros_like(mask), torch.zeros_like(mask)
            if batch is not None:
                for i, span in enumerate(spans):
                    returns[i, span] = batch.columns[cols.RETURNS][i].to(self.device)
                    old[i, span] = batch.columns[cols.VALUES][i].to(self.device)
                    if cfg.policy_mask:
                        mask[i, span] = batch.columns[cols.POLICY_MASK][i].to(mask.device, mask.dtype)
            metrics = self.trainer.step(ValueBatch(tokens, mask, returns, old))
        if batch is not None:
            self.client.ack(batch)
        return metrics


def _pad(batch: Batch | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """Packed tokens, the response mask over label positions, and each row's span (a placeholder row
    with nothing to train when this rank has no batch)."""
    if batch is None:
        return torch.zeros(1, 2, dtype=torch.int64, device=device), torch.zeros(1, 1, device=device), []
    tokens, spans = pack_rows(batch.columns[cols.PROMPT_IDS], batch.columns[cols.RESPONSE_IDS])
    mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=HOST)
    for i, span in enumerate(spans):
        mask[i, span] = 1.0
    return tokens.to(device), mask.to(device), spans
