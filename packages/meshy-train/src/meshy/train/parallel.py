"""The trainer's device mesh and model: built on the meta device, parallelized with
torchtitan's Qwen3 parallelize function (FSDP2 over data-parallel ranks, expert parallelism for a
mixture), then materialised on the local device.

The compute dtype is the recipe's model dtype (one for trainer, publisher and engines), not a parallelism
setting. The default process group is the training role's own (meshy.train.process_group).
"""

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from meshy.dataplane import SchemaError
from meshy.train import cpu
from meshy.train.lora import apply_lora, base_names, init_adapters
from meshy.train.models import DecoderArch
from meshy.train.titan_models import state_dict_adapter, titan_config
from meshy.train.training_config import LoraConfig, ParallelConfig

SPMD_BACKEND = "partial_dtensor"  # DTensor for model-parallel axes only; plain tensors in and out


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ACTIVATION_CHECKPOINTING = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}
ModelDtype = Literal["float32", "bfloat16"]


def build_model(
    arch: DecoderArch,
    config: ParallelConfig,
    *,
    device: str | torch.device,
    dtype: ModelDtype = "float32",
    seed: int = 0,
    lora: LoraConfig | None = None,
) -> tuple[torch.nn.Module, ParallelDims]:
    """The model on `device`, computing in `dtype` over float32 weights, initialised from `seed`; with `lora`,
    its base frozen and low-rank adapters on the projections `lora` targets (meshy.train.lora), the only
    parameters that train.

    Every process applies the same torchtitan parallelize step (activation checkpointing, compile); the
    processes of a role with several share the model with FSDP2, whose mixed-precision policy computes
    in `dtype`. A single process is not sharded, so it computes in `dtype` under autocast, as
    torchtitan's own trainer does on one device.

    Adapters are added to the model on the meta device, before it is parallelized: FSDP2 shards them with
    their blocks, activation checkpointing and compile wrap the blocks that hold them. The base is
    initialised as it is without adapters, the adapters from `seed` (meshy.train.lora.init_adapters).
    (Tensor and context parallelism, which would split the adapters too, are refused by ParallelConfig.)"""
    if dtype not in DTYPES:
        raise SchemaError(f"build_model dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    device = torch.device(device)
    if device.type == "cpu":
        cpu.use_cpu_device()
    world = dist.get_world_size() if dist.is_initialized() else 1
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=config.dp_shard,
        data_parallel_replicate_degree=config.dp_replicate,
        tensor_parallel_degree=config.tp,
        expert_parallel_degree=config.ep,
        context_parallel_degree=config.cp,
        spmd_backend=SPMD_BACKEND,
    )
    dims = ParallelDims.from_config(parallelism, world)
    model_config = titan_config(arch)
    # What torchtitan's own trainer sets from its parallelism config: without it `parallelize` shards no
    # parameter, while the MoE token dispatcher still sends each rank only its share of the experts' tokens.
    set_qwen3_sharding_config(
        model_config,
        enable_sp=parallelism.enable_sequence_parallel,
        enable_ep=parallelism.expert_parallel_degree > 1,
    )
    with torch.device("meta"):
        model = model_config.build()
    if lora is not None:
        apply_lora(model, lora)
    if world > 1:
        dims.build_mesh()
        set_spmd_backend(SPMD_BACKEND)
    model = parallelize_qwen3(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=dtype),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=config.compile, components=["model"] if config.compile else []),
        ac_config=ACTIVATION_CHECKPOINTING[config.activation_checkpoint],
        dump_folder="",
        skip_dp=world == 1,
    )
    if world > 1 and device.type == "cpu":
        cpu.sum_gradient_reduction(model)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if lora is not None:
        init_adapters(model, seed)
    if world == 1 and dtype != "float32":  # the output projection too, when called alone (response_logits)
        for module in (model, model.lm_head):
            module.forward = torch.autocast(device.type, dtype=DTYPES[dtype])(module.forward)
    model.train()
    return model, dims


def shard_beside(module: torch.nn.Module, model: torch.nn.Module) -> None:
    """Shard `module`, which computes beside a model from build_model (the critic's value head), over
    the model's data-parallel ranks as the model is sharded: float32 parameters, gradients summed (losses
    are divided by global counts). Without it the two hold plain and sharded tensors side by side, which
    gradient clipping refuses. A model on one process is not sharded, nor is the module."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    if mesh is None:
        return
    on_cpu = next(module.parameters()).device.type == "cpu"
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    module.set_gradient_divide_factor(1.0)
    if on_cpu:
        cpu.sum_gradient_reduction(module)


def load_weights(model: torch.nn.Module, arch: DecoderArch, hf_tensors: dict[str, torch.Tensor]) -> None:
    """Load full HF-named tensors (the same on every rank) into a possibly sharded model. A model with
    adapters takes them as its base (each adapted weight into its `base_layer`); its adapters are untouched."""
    state = state_dict_adapter(arch).from_hf(dict(hf_tensors))  # from_hf mutates its argument
    names = base_names(model)
    if set(state) != set(names):
        missing, extra = sorted(set(names) - set(state)), sorted(set(state) - set(names))
        raise SchemaError(f"weights do not fit {arch.architecture}: missing {missing[:5]}, unexpected {extra[:5]}")
    state = {names[name]: tensor for name, tensor in state.items()}
    # Not strict where the adapters are left out (every other entry was checked above): they keep their values.
    options = StateDictOptions(full_state_dict=True, strict=len(state) == len(model.state_dict()))
    set_model_state_dict(model, state, options=options)
