"""The training role: the policy trainer service, from the first weights version to the last."""

import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshy.dataplane.weights import WEIGHTS_STREAM, Transport
from meshy.recipes.launch.startup import phase_done
from meshy.recipes.observe.metric_sinks import MetricSinks
from meshy.recipes.observe.progress import Progress
from meshy.recipes.roles.colocation import BUILD, DeviceTurns, record_released
from meshy.recipes.roles.context import RecordKind, RoleContext, announce_stop
from meshy.recipes.roles.reference_weights import publish_reference
from meshy.recipes.usercode.held_out import EVAL_DIR, EVAL_WEIGHTS, EvalFigures, EvalResults
from meshy.recipes.weights.pretrained import load_init
from meshy.train import checkpoint, offload
from meshy.train.parallel import build_model
from meshy.train.publish import CollectivePublisher, DirectoryPublisher, KeepingPublisher, SharedMemoryPublisher
from meshy.train.service import MetricsLog, TrainingService, TrainServiceConfig
from meshy.train.trainer import PolicyTrainer

KEPT = "hf_versions"  # the run's every hf_every-th version (recipe.hf_every)
LORA_BASE_ROOT = "lora"  # where a LoRA run's final adapters find their base (lora/base), unless published on disk
MERGED_ROOT = "merged"  # where the merged final model is written before it moves into final_weights/merged


class TrainingRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe, algo = ctx.recipe, ctx.recipe.algorithm
        self.arch = recipe.model.arch()
        self.device, dtype = torch.device(ctx.slot.device), recipe.model.dtype
        self.turns = DeviceTurns(ctx, lambda _: offload.move(self.trainer, self.device), self._offload)
        with self.turns.turn(BUILD):
            model, _ = build_model(
                self.arch, algo.parallel, device=self.device, dtype=dtype, seed=recipe.seed, lora=recipe.model.lora
            )
            self.trainer = PolicyTrainer(model, algo.optim, algo.loss)
        if recipe.publish is Transport.SHARED_MEMORY:
            publisher = SharedMemoryPublisher(f"meshy-{ctx.run_dir.name}", self.arch, ctx.client, dtype=dtype)
        elif recipe.publish is Transport.COLLECTIVE:
            publisher = CollectivePublisher(ctx.weight_sync, self.arch, ctx.client, dtype=dtype, delta=recipe.delta)
        else:
            publisher = DirectoryPublisher(ctx.run_dir / "weights", self.arch, ctx.client, dtype=dtype, keep=4)
        self.publisher = publisher
        if recipe.hf_every:
            publisher = KeepingPublisher(publisher, recipe.hf_every, ctx.run_dir / KEPT, self.arch, dtype)
        if recipe.eval is not None:  # the versions the eval role evaluates, handed over as HF directories
            root = ctx.run_dir / EVAL_DIR
            publisher = KeepingPublisher(
                publisher,
                recipe.eval.every,
                root,
                self.arch,
                dtype,
                last=recipe.steps,
                client=ctx.client,
                stream=EVAL_WEIGHTS,
            )
        config = TrainServiceConfig(
            table=ctx.table,
            groups_per_rank=algo.prompts_per_step // ctx.slot.count,
            minibatches=algo.minibatches,
            epochs=algo.epochs,
            max_staleness=algo.max_staleness,
            distill=algo.kind == "distill",
            kl_to_reference=algo.loss.kl_coef > 0,
            checkpoint_every=recipe.checkpoint_every,
            checkpoint_in_background=recipe.checkpoint_in_background,
            critic_warmup_versions=algo.critic_warmup_versions,
            report_reward=True,
            routing_replay=algo.routing_replay,
            policy_mask=recipe.multi_turn,
            # bounded pacing: version v trains batch v (rollout numbers batch b's groups from b * prompts_per_step)
            batch_groups=algo.prompts_per_step if algo.window is not None else None,
            # rows on disk outlive a stopped run: those trained after the newest checkpoint are trained again
            # from it instead of generated again. Not in PPO runs (the critic acks as it trains) nor with routing
            # replay (a row's routing is layers x top_k per token: too large to hold for checkpoint_every versions)
            ack_when_checkpointed=recipe.dataplane.durable != "off"
            and recipe.checkpoint_every > 0
            and algo.kind != "ppo"
            and not algo.routing_replay,
        )
        self.service = TrainingService(
            ctx.client,
            self.trainer,
            publisher,
            config,
            metrics=MetricsLog(ctx.run_dir / "metrics.jsonl"),
            checkpoint_dir=ctx.run_dir / "checkpoints",
        )
        self.lead = ctx.slot.index == 0
        if self.lead:
            phase_done("training built")

    def run(self) -> None:
        ctx, steps, turns = self.ctx, self.ctx.recipe.steps, self.turns
        with turns.turn():
            self.service.version = self._restore()
            if ctx.recipe.roles.reference is not None:
                publish_reference(ctx, self.trainer.model, self.arch, self.service.version)
            self.service.publish_initial()
            if self.lead:
                restored = " (the newest checkpoint's)" if self.service.version else ""
                phase_done(f"version {self.service.version}{restored} published")
        # the lead's sinks are closed as the run ends, marked failed when it ends by an exception
        with MetricSinks.open(ctx.recipe, ctx.run_dir) if self.lead else MetricSinks([]) as sinks:
            progress = Progress(ctx.run_dir, steps, self._metrics(), sinks) if self.lead else None
            results = EvalResults(ctx.client) if self.lead and ctx.recipe.eval is not None else None
            self._evaluated = {m["version"] for m in self._metrics() if "eval/accuracy" in m}
            ctx.record(RecordKind.TRAIN_START, version=self.service.version)
            try:
                while self.service.version < steps:
                    start = time.perf_counter()
                    batch = self.service.wait_for_batch()
                    if self.lead:
                        phase_done("first batch ready to train")
                    with turns.turn() as turn:
                        record = self.service.train_batch(batch, waited=time.perf_counter() - start)
                        turn.payload = {"version": self.service.version}
                    if progress is not None:
                        progress.step(record)
                        ctx.record(RecordKind.VERSION, version=record["version"], reward_mean=record.get("reward_mean"))
                    if results is not None:
                        for figures in results.drain():
                            self._eval_line(progress, figures)
            finally:
                self.service.close()
                turns.close()
            final = self._keep_final_weights()
            if results is not None:
                self._final_eval(progress, results)
        if self.lead:
            curve = progress.close(ctx.recipe.name)
            kind = "HF" if ctx.recipe.model.lora is None else "a PEFT adapter; its base: adapter_config.json"
            announce_stop(ctx.client, f"trained {steps} versions")
            print(
                f"run directory: {ctx.run_dir}\n  final weights ({kind}): {final}\n  reward curve: {curve}\n"
                f"  metrics: {ctx.run_dir / 'metrics.jsonl'} and {ctx.run_dir / 'tensorboard'}",
                flush=True,
            )
        if dist.is_initialized():
            dist.barrier()

    def _eval_line(self, progress: Progress, figures: EvalFigures) -> None:
        """An evaluated version's figures in metrics.jsonl, TensorBoard and the progress lines (once: a
        resumed run may evaluate its restored version again)."""
        if figures.version in self._evaluated:
            return
        self._evaluated.add(figures.version)
        line = figures.metrics()
        self.service.metrics.write(line)
        progress.eval(line)

    def _final_eval(self, progress: Progress, results: EvalResults) -> None:
        """The final weights' figures, which the eval role computes after the last version: waited for, up
        to stall_after_s, saying so (unless they came with the last version's batch already)."""
        steps, limit = self.ctx.recipe.steps, self.ctx.recipe.stall_after_s
        if steps not in self._evaluated:
            print(
                f"waiting for the eval role's figures of the final weights (v{steps}), up to {limit:.0f} s", flush=True
            )
            for figures in results.wait_for(steps, limit):
                self._eval_line(progress, figures)
        results.close()
        if steps not in self._evaluated:
            print(
                f"eval: no figures of the final weights (v{steps}) within stall_after_s ({limit:.0f} s); "
                "metrics.jsonl lacks them, and records/eval-0.jsonl says how far the eval role got",
                flush=True,
            )

    def _restore(self) -> int:
        """The version to carry on from: the newest checkpoint's (restored into the trainer), or 0 (with
        the recipe's initial weights loaded, unless it starts from scratch). What a stopped run wrote after
        that checkpoint (weights versions, metrics lines) is discarded, so the run continues as if it had
        never stopped; the restored version is then published again. Under LoRA the checkpoint holds the
        adapters only: the base is the recipe's initial weights again."""
        resumed = checkpoint.latest(self.ctx.run_dir / "checkpoints")
        if resumed is not None:
            if self.ctx.recipe.model.lora is not None:  # a LoRA checkpoint holds the adapters, not the base
                load_init(self.trainer.model, self.arch, self.ctx.recipe.model.init)
            cursors = checkpoint.load(resumed, self.trainer)
            version = cursors["version"]
            self.service.best_reward = cursors.get("best_reward", -math.inf)  # checkpoints before it: unknown
        else:
            version = 0
            load_init(self.trainer.model, self.arch, self.ctx.recipe.model.init)
        if self.lead:
            shutil.rmtree(self.ctx.run_dir / EVAL_DIR, ignore_errors=True)  # versions the eval role never took
            for directory in (self.ctx.run_dir / "weights", self.ctx.run_dir / KEPT):
                for stale in directory.glob("v[0-9]*"):
                    if stale.name[1:].isdigit() and int(stale.name[1:]) >= version:
                        shutil.rmtree(stale)
                for torn in directory.glob(".v[0-9]*.tmp*"):  # a version being written when the run stopped
                    shutil.rmtree(torn)
            kept = [m for m in self._metrics() if m["version"] <= version]
            (self.ctx.run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
        return version

    def _metrics(self) -> list[dict]:
        path = self.ctx.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def _offload(self) -> None:
        """Hand the devices over: the trainer's tensors to host memory, the freed memory to the driver."""
        offload.hand_over(self.trainer, self.device)
        record_released(self.ctx)

    def _keep_final_weights(self) -> Path:
        """The last version as an HF directory, in the dtype every version was published in, whatever the
        transport; every rank calls it (gathering the model is a collective). Under LoRA, a PEFT adapter
        directory whose adapter_config.json names its base (the disk publisher's weights/base, or lora/base
        written here), with the merged model in merged/ when model.lora.merge_final says so."""
        final = self.ctx.run_dir / "final_weights"
        if isinstance(self.publisher, DirectoryPublisher):
            if self.lead:
                shutil.copytree(
                    self.ctx.run_dir / "weights" / f"v{self.service.version:06d}", final, dirs_exist_ok=True
                )
        else:  # shared-memory and broadcast versions vanish with the run: write the last one to disk
            self._write_final(LORA_BASE_ROOT, final)
        lora = self.ctx.recipe.model.lora
        if lora is not None and lora.merge_final:
            self._write_final(MERGED_ROOT, final / "merged", adapters=False)
        if self.lead:
            self.ctx.record(RecordKind.FINAL, path=str(final), stream=WEIGHTS_STREAM)
        return final

    def _write_final(self, root: str, directory: Path, adapters: bool = True) -> None:
        """Write the last version under run_dir/root and move it to `directory` (a LoRA version's base stays
        under root, where its adapter_config.json points)."""
        dtype = self.ctx.recipe.model.dtype
        publisher = DirectoryPublisher(self.ctx.run_dir / root, self.arch, None, dtype=dtype, adapters=adapters)
        published = publisher.publish(self.trainer.model, self.service.version)
        if self.lead:
            shutil.rmtree(directory, ignore_errors=True)
            Path(published.location).rename(directory)
            if published.adapter is None:
                (self.ctx.run_dir / root).rmdir()
