"""The built-in roles, all of one shape (a custom role may follow it too):

- `Role(ctx)` takes its settings from `ctx.recipe` (ctx: meshy.recipes.roles.context.RoleContext) and builds
  what it can before the run starts (models, trainers); engines are built in `run()`, in the event loop
  that drives them.
- `run()` watches the `run` stream for the stop (`ctx.watch_for_stop()`; training instead ends the run,
  announcing the stop after its last version), works until `ctx.stop` is set, then records what it did.
- The work is done by services of meshy.train and meshy.infer (rollout's prompts, rewards and
  advantages are its own). A blocking service does one unit of work per call, and the role loops over
  it until the stop (training, critic, rollout). An asyncio service loops itself until an asyncio stop
  event (inference, teacher, reference); the role runs it under `ctx.until_stopped`, the one bridge from
  the role's stop flag to that event. Teacher and reference, which score responses, are one shape
  (meshy.recipes.roles.scoring_role), each saying with which weights and which service.
"""
