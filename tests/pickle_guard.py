"""Test-only: any `torch.distributed` object collective fails the process that calls it. Those collectives pickle
an object on one process and unpickle it on another, which the package's security rule forbids. `nemo_shim.install`
installs this guard, so every NeMo job the tests run (its ranks, spares and their warm-up) proves that nothing on
that path sends a pickle; `tests/test_object_collectives.py` checks that the guard fires."""

from __future__ import annotations

from typing import Any, NoReturn


class PickleCrossedProcesses(AssertionError):
    pass


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise PickleCrossedProcesses(f"a torch.distributed object collective was about to {what} (pickle across "
                                     "processes); use nemo_checkpointless.restart.objects")

    return refuse


_SAVED: dict[str, Any] = {}


def install() -> None:
    """Idempotent; process-wide."""
    from torch.distributed import distributed_c10d as c10d

    if not _SAVED:
        _SAVED.update(_object_to_tensor=c10d._object_to_tensor, _tensor_to_object=c10d._tensor_to_object)
    c10d._object_to_tensor = _refuse("pickle an object for its peers")
    c10d._tensor_to_object = _refuse("unpickle a peer's bytes")


def uninstall() -> None:
    """torch's own functions back (a test of something other than our path)."""
    from torch.distributed import distributed_c10d as c10d

    for name, fn in _SAVED.items():
        setattr(c10d, name, fn)
