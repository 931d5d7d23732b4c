"""The "pipeline" config section: parsed strictly, checked against the PipelineModule."""

from __future__ import annotations

import pytest
from torch import nn

from dstrain.config import DSConfig
from dstrain.errors import ConfigError
from dstrain.pipe import PipelineConfig, PipelineModule
from dstrain.pipe.compose import pipeline_stages

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}


def test_parsed_into_dsconfig() -> None:
    cfg = DSConfig.load({**BASE, "pipeline": {"activation_checkpoint_interval": 2, "p2p_timeout": 30}})
    assert cfg.pipeline == PipelineConfig(activation_checkpoint_interval=2, p2p_timeout=30)
    assert DSConfig.load(BASE).pipeline == PipelineConfig()
    # DeepSpeed's own keys are accepted
    DSConfig.load({**BASE, "pipeline": {"stages": "auto", "partition": "best", "seed_layers": False,
                                         "pipe_partitioned": True, "grad_partitioned": True}})  # fmt: skip


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"activation_checkpoint_intervall": 1}, "pipeline.activation_checkpoint_intervall"),
        ({"activation_checkpoint_interval": -1}, "pipeline.activation_checkpoint_interval"),
        ({"stages": 0}, "pipeline.stages"),
        ({"p2p_timeout": 0}, "pipeline.p2p_timeout"),
        ({"seed_layers": "yes"}, "pipeline.seed_layers"),
    ],
)
def test_typos_and_bad_values_rejected(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        DSConfig.load({**BASE, "pipeline": section})
    assert e.value.field == field


def test_stages_must_match_the_module() -> None:
    model = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, stage_id=0)
    assert pipeline_stages(model) == 2
    assert pipeline_stages(model, PipelineConfig(stages=2)) == 2
    with pytest.raises(ConfigError):
        pipeline_stages(model, PipelineConfig(stages=4))
    with pytest.raises(ConfigError):
        pipeline_stages(nn.Linear(2, 2), PipelineConfig(stages=2))
    assert pipeline_stages(nn.Linear(2, 2)) == 1
