"""The critic role (PPO with a learned critic, JustRL II style): values responses, trains on returns.
The critic is a copy of the policy's initial weights (`model.init`) with a scalar value head."""

from meshy.infer.torch_engine import read_model
from meshy.recipes.context import RoleContext
from meshy.recipes.pretrained import SCRATCH, resolve
from meshy.train.critic import CriticService, CriticServiceConfig, CriticTrainer, ValueModel
from meshy.train.parallel import build_model, load_weights

CRITIC_TRAIN_TASK = "critic_train"


class CriticRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe, algo = ctx.recipe, ctx.recipe.algorithm
        arch = recipe.model.arch()
        backbone, _ = build_model(arch, algo.parallel, seed=recipe.seed)
        if recipe.model.init != SCRATCH:
            _, tensors = read_model(resolve(recipe.model.init))
            load_weights(backbone, arch, tensors)
        model = ValueModel(backbone, arch.hidden_size, algo.initial_value)
        config = CriticServiceConfig(
            table=ctx.table,
            train_task=CRITIC_TRAIN_TASK,
            rows_per_rank=256,
            groups_per_rank=algo.prompts_per_step // ctx.slot.count,
            batch_timeout_s=0.2,
        )
        self.service = CriticService(ctx.client, CriticTrainer(model, algo.critic_optim, algo.value_clip), config)

    def run(self) -> None:
        self.ctx.watch_for_stop()
        valued = steps = 0
        while not self.ctx.stop.is_set():
            valued += self.service.write_values()
            metrics = self.service.train_step(timeout=0.0)
            if metrics is not None:
                steps += 1
                self.ctx.record("critic_step", step=steps, **metrics)
        self.ctx.record("critic", valued=valued, steps=steps)
