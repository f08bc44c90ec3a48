"""Test-only CPU shim: lets megatron-core and NeMo 2 run on gloo without a GPU. Never imported by the package.

megatron-core and NeMo assume CUDA in a few dozen places (see shared/notes/deps.md §3-4): tensors created with
`device=torch.cuda.current_device()` or `device="cuda"`, `Tensor.type() == "torch.cuda.FloatTensor"` checks in the
distributed optimizer, CUDA streams and events around DDP, `pin_memory=True` in NeMo's data sampler, and the CUDA
RNG tracker. `install()` (idempotent, process-wide, call it before building anything) makes each of them work on
CPU:

- a global `TorchFunctionMode` rewrites a CUDA or integer device (and `pin_memory=True`) in any torch call to CPU;
- `Tensor.cuda()` and `Tensor.pin_memory()` return the tensor itself;
- `Tensor.type()` (no argument) reports `torch.cuda.<T>` for a CPU tensor, so the optimizer's dtype checks pass;
- `torch.cuda.current_device/set_device/synchronize/empty_cache/Stream/Event/stream/current_stream/default_stream`
  become CPU stand-ins (`current_device()` is 0, which the mode then maps to CPU);
- Megatron's CUDA RNG tracker stores opaque CPU states: `torch.cuda.get_rng_state()` returns the CPU generator's
  state and setting a CUDA state is a no-op (CUDA RNG contents are one of the things CPU cannot cover).

Nothing here changes numerics: every op still runs on the CPU kernels it would run on without the shim.

`install()` also installs `pickle_guard` (not a CPU matter): a torch.distributed object collective fails the process,
so every NeMo job of the tests shows that nothing on its path sends a pickle between processes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_thread_state = threading.local()


def _cpu_device(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuDeviceMode(TorchFunctionMode):
    """Any torch call asked to put a tensor on a GPU (or to pin it) puts it on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.cuda) or getattr(func, "__name__", "") == "to":
            args = tuple(_cpu_device(a) if i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream stand-in: every operation is synchronous on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


@contextlib.contextmanager
def _stream_ctx(stream: Any = None) -> Iterator[None]:
    yield


def install() -> None:
    """Install every part of the shim in this process (idempotent). Call before megatron/NeMo build anything.
    The device mode lives on the calling thread's mode stack: a thread that builds models (a spare's warm-up
    thread) calls `install` too."""
    global _installed
    if not getattr(_thread_state, "mode", False):
        _thread_state.mode = True
        _CpuDeviceMode().__enter__()  # left entered for the life of the thread
    if _installed:
        return
    _installed = True

    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    original_type = torch.Tensor.type

    def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original_type(self)
            # The C method dispatches a subclass (Parameter) back through this function: rename once.
            if self.device.type != "cpu" or name.startswith("torch.cuda."):
                return name
            return name.replace("torch.", "torch.cuda.", 1)
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type  # type: ignore[method-assign,assignment]

    cuda: Any = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.stream = _stream_ctx
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    install_rng()
    # Not part of the CPU shim: every NeMo job of the tests also proves that no object collective (a pickle from
    # a peer) runs on its path.
    import pickle_guard

    pickle_guard.install()


def install_rng() -> None:
    """Megatron's CUDA RNG tracker on CPU: states are opaque CPU generator states; setting one is a no-op."""
    cuda: Any = torch.cuda
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.manual_seed = lambda *a, **k: None
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda *a, **k: None  # type: ignore[assignment]
