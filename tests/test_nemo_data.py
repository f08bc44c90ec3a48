"""`nemo.MmapDataModule` (tier 2 for a NeMo user's data module) refuses what its cache cannot serve with one
`ConfigError` that names the key, the value, the rule and the fix: a module without Megatron's data sampler or
with its random one, no training dataset, an iterable-style one, samples that are not tensors. A module it can
serve, set up outside the launcher, is the module itself. In-process (no ranks: nothing here is collective);
the real runs through the cache are `test_nemo_user_script.py`'s. Skipped without the [nemo] extra."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning import pytorch as pl

from nemo_checkpointless.errors import ConfigError

pytestmark = pytest.mark.nemo


class _Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    def __iter__(self) -> Any:
        return iter([{"tokens": torch.zeros(4, dtype=torch.int64)}])


class _Texts(torch.utils.data.Dataset[str]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> str:
        return f"text {i}"


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.full((4,), i, dtype=torch.int64), "loss_mask": torch.ones(4)}


def _module(dataset: Any = None, sampler: Any = "megatron") -> pl.LightningDataModule:
    from nemo.lightning.pytorch.plugins import MegatronDataSampler

    class UserData(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            if sampler == "megatron":
                self.data_sampler = MegatronDataSampler(seq_len=4, micro_batch_size=2, global_batch_size=4)
            elif sampler is not None:
                self.data_sampler = sampler

        def setup(self, stage: str = "") -> None:
            if dataset is not None:
                self._train_ds = dataset

    return UserData()


def _refusal(module: Any, stage: str | None = None) -> ConfigError:
    from nemo_checkpointless.nemo import MmapDataModule

    with pytest.raises(ConfigError) as e:
        wrapped = MmapDataModule(module)
        assert stage is not None, "refused only in setup"
        wrapped.setup(stage)
    return e.value


def test_a_module_without_megatrons_sampler_is_refused_naming_it() -> None:
    from nemo.lightning.pytorch.plugins import MegatronDataSampler

    e = _refusal(_module(_Tokens(), sampler=None))
    assert e.key == "MmapDataModule(UserData).data_sampler" and e.value is None
    assert "MegatronDataSampler" in e.rule and "self.data_sampler = MegatronDataSampler(" in e.fix
    assert "pass the data module unwrapped" in e.fix
    e = _refusal(_module(_Tokens(), sampler=torch.utils.data.SequentialSampler(range(8))))
    assert e.value == "SequentialSampler"
    cyclic = MegatronDataSampler(seq_len=4, micro_batch_size=2, global_batch_size=4, dataloader_type="cyclic")
    e = _refusal(_module(_Tokens(), sampler=cyclic))
    assert str(e).startswith("MmapDataModule(UserData).data_sampler.dataloader_type='cyclic': must be 'single'"), e
    assert "dataloader_type='single'" in e.fix
    e = _refusal([])  # not a data module at all
    assert e.key == "MmapDataModule(module)" and e.value == "list"


def test_a_dataset_the_cache_cannot_serve_is_refused_in_setup() -> None:
    e = _refusal(_module(None), stage="fit")
    assert e.key == "MmapDataModule(UserData)" and "self._train_ds" in e.fix
    e = _refusal(_module(_Stream()), stage="fit")
    assert e.key == "UserData._train_ds" and e.value == "_Stream" and "iterable-style" in e.rule
    assert "map-style" in e.fix
    e = _refusal(_module(_Texts()), stage="fit")
    assert str(e).startswith("UserData._train_ds[0]=str: a sample must be a tensor"), e
    assert "_Texts.__getitem__" in e.fix


def test_a_module_it_can_serve_is_the_module_itself_outside_the_launcher() -> None:
    from nemo_checkpointless.nemo import MmapDataModule

    dataset = _Tokens()
    module = _module(dataset)
    wrapped = MmapDataModule(module)
    wrapped.setup("fit")
    assert module._train_ds is dataset and wrapped.loader is None  # type: ignore[attr-defined]
    assert wrapped.data_sampler is module.data_sampler  # type: ignore[attr-defined]
    MmapDataModule(_module(None)).setup("validate")  # no training dataset needed to validate
