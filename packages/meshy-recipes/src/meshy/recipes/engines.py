"""The engine a recipe names (`sampling.engine`), built for one role process: the inference role's
generator and the teacher role's scorer both come from here."""

from meshy.infer.engine import Engine
from meshy.infer.torch_engine import ModelSource, TorchEngine
from meshy.recipes.context import RoleContext


def build_engine(ctx: RoleContext, source: ModelSource, colocate: bool = False) -> Engine:
    """SGLang (imported only when named) or the pure-torch engine, on the process's device, sized by
    `sampling.max_in_flight` and `sampling.context_length`. colocate: the engine will release and onload
    its device memory for a GPU token ring."""
    sampling = ctx.recipe.sampling
    if sampling.engine == "sglang":
        from meshy.infer.sglang_engine import SGLangEngine

        # SGLang takes "cuda" plus the first GPU and a tensor-parallel width, not a "cuda:k" device.
        gpus = {"base_gpu_id": ctx.slot.devices[0], "tp_size": len(ctx.slot.devices)} if ctx.slot.devices else {}
        return SGLangEngine(
            source,
            max_running=sampling.max_in_flight,
            max_len=sampling.context_length,
            device="cuda" if ctx.slot.devices else "cpu",
            colocate=colocate,
            **gpus,
        )
    return TorchEngine(
        source, max_running=sampling.max_in_flight, max_len=sampling.context_length, device=ctx.slot.device
    )
