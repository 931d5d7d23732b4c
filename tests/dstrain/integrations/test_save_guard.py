"""`guard_save_pretrained`: a model with Hugging Face's ``save_pretrained`` refuses to save released
(ZeRO-3 partitioned) parameters; other modules are left alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dstrain.errors import PartitionedSaveError
from dstrain.integrations.save_guard import SavesPretrained, guard_save_pretrained


class Pretrained(nn.Linear):
    """Not a transformers model: the method is the contract."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.saved: list[tuple[Any, ...]] = []

    def save_pretrained(self, directory: str, **kwargs: Any) -> str:
        self.saved.append((directory, sorted(kwargs)))
        return "saved"


def test_a_plain_module_is_left_alone() -> None:
    plain = nn.Linear(4, 4)
    assert not isinstance(plain, SavesPretrained)
    assert guard_save_pretrained(plain) is False
    assert "save_pretrained" not in vars(plain)


def test_released_parameters_refuse_gathered_ones_save() -> None:
    model = Pretrained()
    assert isinstance(model, SavesPretrained) and guard_save_pretrained(model) is True
    assert model.save_pretrained("out") == "saved"  # whole parameters: saves as before
    model.weight.untyped_storage().resize_(0)  # what ZeRO-3 does between uses
    with pytest.raises(PartitionedSaveError):
        model.save_pretrained("out")
    state = {"weight": torch.zeros(4, 4)}  # a gathered state_dict passed in is fine
    assert model.save_pretrained("out", state_dict=state) == "saved"
    assert model.saved == [("out", []), ("out", ["state_dict"])]
