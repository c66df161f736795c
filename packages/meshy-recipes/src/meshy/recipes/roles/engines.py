"""The engine a recipe names (`sampling.engine`), built for one role process: the inference role's
generator and the teacher role's scorer both come from here."""

from meshy.dataplane.adapters import Adapter
from meshy.dataplane.model_source import ModelSource
from meshy.infer.engine import Engine
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.roles.sync_group import weight_sync_rank


def build_engine(
    ctx: RoleContext,
    source: ModelSource,
    colocate: bool = False,
    version: int | None = None,
    record_routing: bool = False,
    max_running: int | None = None,
    adapter: Adapter | None = None,
) -> Engine:
    """SGLang (imported only when named) or the pure-torch engine, on the process's device in the
    recipe's model dtype, sized by `sampling.max_in_flight` and `sampling.context_length`. colocate: the
    engine will release and onload its device memory for a GPU token ring. version: the weights version
    `source` holds (default: a Published source's, else 0). record_routing: the engine reports a
    mixture's experts per generated token (routing replay; TorchEngine always does for a mixture).
    max_running: requests at once, if fewer than sampling.max_in_flight will ever come. adapter: a LoRA
    version's adapters, when `source` is its received tensors (a Published carries its own). The process's
    records say which engine it built."""
    running = max_running or ctx.recipe.sampling.max_in_flight
    engine = _engine(ctx, source, colocate, version, record_routing, running, adapter)
    ctx.record(RecordKind.ENGINE, engine=type(engine).__name__, device=ctx.slot.device, dtype=ctx.recipe.model.dtype)
    return engine


def _engine(
    ctx: RoleContext,
    source: ModelSource,
    colocate: bool,
    version: int | None,
    record_routing: bool,
    max_running: int,
    adapter: Adapter | None,
) -> Engine:
    sampling, dtype = ctx.recipe.sampling, ctx.recipe.model.dtype
    if sampling.engine == "sglang":
        from meshy.infer.sglang_engine import SGLangEngine

        # SGLang takes "cuda" plus the first GPU and a tensor-parallel width, not a "cuda:k" device.
        placement = {"base_gpu_id": ctx.slot.devices[0], "tp_size": len(ctx.slot.devices)} if ctx.slot.devices else {}
        fraction = dict(ctx.recipe.roles.items())[ctx.slot.role].memory_fraction
        if fraction is not None:  # SGLang sizes its weights and cache from its own share of the GPU
            placement["mem_fraction_static"] = fraction
        # Holds end SGLang's requests, to be continued here: each attempt reports its own tokens' routing.
        routing = {"record_routing": True, "pause_mode": "abort"} if record_routing else {}
        return SGLangEngine(
            source,
            max_running=max_running,
            max_len=sampling.context_length,
            device="cuda" if ctx.slot.devices else "cpu",
            dtype=dtype,
            colocate=colocate,
            version=version,
            weight_sync_rank=weight_sync_rank(ctx.recipe, ctx.slot),
            **placement,
            **routing,
        )
    return TorchEngine(
        source,
        max_running=max_running,
        max_len=sampling.context_length,
        device=ctx.slot.device,
        dtype=dtype,
        version=version,
        compile=sampling.compile,
        adapter=adapter,
    )
