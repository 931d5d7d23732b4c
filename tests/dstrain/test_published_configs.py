"""DeepSpeed configs people have, loaded unmodified (tests/dstrain/fixtures/configs/README.md lists their
sources): each trains (3 steps) under `dstrain.initialize` once a trainer fills the "auto" values only it knows."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _dstrain_helpers import DIM, global_batch, make_model

import dstrain
from dstrain.config import read_config_file
from dstrain.config_auto import fill_auto

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
FILES = sorted(p.name for p in CONFIGS.iterdir() if p.suffix in (".json", ".hjson"))

# what HF's Trainer fills from TrainingArguments (per_device_train_batch_size 2, accumulation 1,
# learning_rate 1e-3, adam betas/eps, weight_decay 0, max_grad_norm 1, warmup 2 of 10 steps, fp32)
TRAINER = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 2,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_num_steps": 2,
    "scheduler.params.total_num_steps": 10,
    "fp16.enabled": False,
    "bf16.enabled": False,
}


def _hf_like_model() -> Any:
    model = make_model()
    model.config = SimpleNamespace(hidden_size=DIM)  # what a transformers model carries
    return model


@pytest.mark.parametrize("name", FILES)
def test_published_config_trains(name: str, one_thread: None) -> None:
    raw = read_config_file(CONFIGS / name)
    if not any(k in raw for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        raw = {"train_micro_batch_size_per_gpu": 2, **raw}  # a documentation snippet of one section
    if "optimizer" not in raw:
        raw = {**raw, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # HF's default optimizer
    cfg = fill_auto(raw, TRAINER)
    engine, _, _, _ = dstrain.initialize(model=_hf_like_model(), config=cfg)
    z = engine.config.zero_optimization
    zero_raw = raw["zero_optimization"]
    if zero_raw.get("reduce_bucket_size") == "auto":  # HF's rule: from the hidden size
        assert z.reduce_bucket_size == DIM * DIM
    for key in ("stage3_prefetch_bucket_size", "prefetch_bucket_size"):
        if zero_raw.get(key) == "auto":
            assert z.stage3_prefetch_bucket_size == int(0.9 * DIM * DIM)
    for key in ("stage3_param_persistence_threshold", "param_persistence_threshold"):
        if zero_raw.get(key) == "auto":
            assert z.stage3_param_persistence_threshold == 10 * DIM
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    losses = []
    for step in range(3):  # a WarmupLR runs its first two steps at warmup_min_lr (0 here), as in DeepSpeed
        loss = engine(*global_batch(step, engine.config.train_micro_batch_size_per_gpu))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = engine.full_state_dict()
    engine.close()
    assert all(math.isfinite(loss) for loss in losses)
    if name != "hf_tests_zero3.json":  # its WarmupLR starts at warmup_min_lr 0 (and fp16 at scale 2^16 skips)
        assert not torch.equal(before["block.0.weight"], after["block.0.weight"])  # it trained
