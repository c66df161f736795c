"""The critic role (PPO with a learned critic, JustRL II style): values responses, trains on returns.

The critic is a copy of the policy's initial weights (`model.init`) with a scalar value head. It
checkpoints with the policy: when a version that is a multiple of `checkpoint_every` has been announced
on every critic rank, they save their state under that version. A resumed run restores the critic
saved at the policy's restored version or the newest before it, and discards the later ones.
"""

import shutil

import torch
import torch.distributed as dist

from meshy.dataplane import HOST
from meshy.dataplane.weights import WEIGHTS_STREAM
from meshy.recipes.roles.colocation import BUILD, DeviceTurns, record_released, step_burst
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.weights.pretrained import load_init
from meshy.train import checkpoint, offload
from meshy.train.collectives import reduce_over_ranks
from meshy.train.critic_service import CriticService, CriticServiceConfig, CriticTrainer, ValueModel
from meshy.train.parallel import build_model

CHECKPOINTS = "critic_checkpoints"  # under the run directory, next to the policy's "checkpoints"
ROWS_PER_FORWARD = 256  # the most rows a critic process values in one forward


class CriticRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe, algo = ctx.recipe, ctx.recipe.algorithm
        arch = recipe.model.arch()
        rows, wait_s = step_burst(ctx)
        config = CriticServiceConfig(
            table=ctx.table,
            rows_per_rank=ROWS_PER_FORWARD,
            groups_per_rank=algo.prompts_per_step // ctx.slot.count,
            batch_timeout_s=0.2,
            policy_mask=recipe.multi_turn,
            burst_rows=min(rows, ROWS_PER_FORWARD),
            burst_wait_s=wait_s,
        )
        self.device = torch.device(ctx.slot.device)
        self.turns = DeviceTurns(
            ctx, on_acquire=lambda _: offload.move(self.service.trainer, self.device), on_release=self._offload
        )
        with self.turns.turn(BUILD):
            backbone, _ = build_model(
                arch, algo.parallel, device=self.device, dtype=recipe.model.dtype, seed=recipe.seed
            )
            model = ValueModel(backbone, arch.hidden_size, algo.initial_value)
            trainer = CriticTrainer(model, algo.critic_optim, algo.value_clip)
            self.service = CriticService(ctx.client, trainer, config, device_turn=self.turns.turn)
            self.saved_version = self._restore()
            if self.saved_version == 0:
                load_init(backbone, arch, recipe.model.init)
        root = ctx.run_dir / CHECKPOINTS
        self.background_saves = checkpoint.BackgroundSaves(root) if recipe.checkpoint_in_background else None

    def _offload(self) -> None:
        offload.hand_over(self.service.trainer, self.device)
        record_released(self.ctx)

    def _restore(self) -> int:
        """The version of the critic state restored for a resumed run (0: none)."""
        policy = checkpoint.latest(self.ctx.run_dir / "checkpoints")
        root = self.ctx.run_dir / CHECKPOINTS
        restored = None if policy is None else checkpoint.latest(root, at_most=checkpoint.step_of(policy))
        if restored is not None:
            checkpoint.load(restored, self.service.trainer)
        version = 0 if restored is None else checkpoint.step_of(restored)
        if self.ctx.slot.index == 0:
            for later in checkpoint.saved(root):
                if checkpoint.step_of(later) > version:
                    shutil.rmtree(later)
        return version

    def run(self) -> None:
        ctx, every = self.ctx, self.ctx.recipe.checkpoint_every
        ctx.watch_for_stop()
        ctx.record(RecordKind.CRITIC_START, version=self.saved_version, steps=self.service.trainer.steps)
        weights = ctx.client.reader(WEIGHTS_STREAM, f"critic-{ctx.slot.index}-checkpoints", start="latest")
        announced = valued = steps = 0
        try:
            while not ctx.stop.is_set():
                valued += self.service.write_values()
                metrics = self.service.train_step(timeout=0.0)
                if metrics is not None:
                    steps += 1
                    ctx.record(RecordKind.CRITIC_STEP, step=steps, **metrics)
                for message in weights.read(max_n=1024, timeout=0.0):
                    announced = max(announced, message.payload["version"])
                if every:
                    self._checkpoint_due(announced // every * every)
        finally:
            if self.background_saves is not None:
                self.background_saves.close()  # the checkpoint being written is finished (or its error raised)
        self.turns.close()
        ctx.record(RecordKind.CRITIC, valued=valued, steps=steps)

    def _checkpoint_due(self, version: int) -> None:
        """Save under the newest checkpoint version every critic rank has seen announced, once."""
        agreed = int(reduce_over_ranks(torch.tensor([float(version)], device=HOST), dist.ReduceOp.MIN).item())
        if agreed > self.saved_version:
            if self.background_saves is not None:
                self.background_saves.save(agreed, self.service.trainer, {"version": agreed})
            else:
                checkpoint.save(self.ctx.run_dir / CHECKPOINTS, agreed, self.service.trainer, {"version": agreed})
            self.saved_version = agreed
            self.ctx.record(RecordKind.CRITIC_CHECKPOINT, version=agreed, steps=self.service.trainer.steps)
