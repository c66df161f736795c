"""TEST-ONLY stand-in for `sgl_kernel`, so SGLang's CPU path runs where the real package cannot load.

The PyPI `sglang-kernel` wheel is CUDA-only (importing it fails without libcuda) and SGLang's CPU kernel
build is not on PyPI. SGLang's CPU path (SGLANG_USE_CPU_ENGINE=1, attention_backend="torch_native")
needs one op from it; this package implements that op in plain torch. Any other name can be imported
(SGLang imports many at module load) but raises NotImplementedError when called, so a code path that
would need a real kernel fails loudly instead of computing something wrong.

It also stands in for the one CUDA runtime call SGLang makes on its CPU path: the host buffer that
collects a mixture's routed experts (enable_return_routed_experts) is pinned with cudaHostRegister,
which only speeds up copies from a GPU. Where CUDA is missing, registering and unregistering host memory
succeed and do nothing; any other runtime call raises. For the same reason, SGLang's LoRA layers and its
torch_native LoRA backend pin the small host tensors they build (`pin_memory=True`, `.pin_memory()`), which
raises where CUDA is missing: there, pinning returns the tensor as it is.
"""

import functools

import torch

__version__ = "0.0.0+meshy-test-stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Writes each request's slice of out_cache_loc (consecutive, in batch order) into its row of
    req_to_token at [start_offset, end_offset)."""
    del pool_len  # the row length; req_to_token already has it
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start]
        taken += end - start


class _MissingKernel:
    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{self.__name__} is not in the test stand-in (tests/infer/sglang_stub)")


class _HostRegistrationOnly:
    """torch.cuda.cudart() where there is no CUDA: host-memory (un)registration succeeds as a no-op."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0

    def __getattr__(self, name: str):
        raise NotImplementedError(f"torch.cuda.cudart().{name} is not in the test stand-in (tests/infer/sglang_stub)")


def _unpinned(factory):
    """A torch tensor factory that ignores pin_memory (pinned host memory needs CUDA)."""

    @functools.wraps(factory)
    def make(*args, pin_memory: bool = False, **kwargs):
        return factory(*args, **kwargs)

    return make


if not torch.cuda.is_available():
    torch.cuda.cudart = _HostRegistrationOnly
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
        setattr(torch, _name, _unpinned(getattr(torch, _name)))


def __getattr__(name: str) -> _MissingKernel:
    if name.startswith("__"):  # import machinery and introspection probe dunders: answer as a plain module
        raise AttributeError(name)
    return _MissingKernel(name)
