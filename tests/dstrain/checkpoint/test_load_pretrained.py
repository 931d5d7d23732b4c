"""``dstrain.checkpoint.load_pretrained``: Hugging Face style safetensors checkpoints (one file,
sharded with an index, dsio's own files) streamed into zero.Init partitions (device, host, NVMe),
each rank reading only its shards' bytes; typed errors listing mismatched keys."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import Tiny, base_config, engine_losses, scratch_dir, spawn
from safetensors.torch import save_file

import dsio
import dstrain
from dstrain.checkpoint import load_pretrained
from dstrain.errors import InitError, PretrainedMismatchError
from dstrain.zero import GatheredParameters, Init

STEPS = 2


def _pretrained(seed: int = 7) -> dict[str, torch.Tensor]:
    """A Tiny state dict with other values than seed 0 builds (HF layout: the tied head omitted)."""
    torch.manual_seed(seed)
    sd = {k: v.detach().clone() for k, v in Tiny().state_dict().items()}
    del sd["head.weight"]  # tied to emb.weight: HF writes one of them
    return sd


def _write(kind: str, root: Path, sd: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if kind == "single":
        save_file(sd, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    if kind == "sharded":
        keys = sorted(sd)
        halves = {
            "model-00001-of-00002.safetensors": keys[::2],
            "model-00002-of-00002.safetensors": keys[1::2],
        }
        wmap = {}
        for fname, ks in halves.items():
            save_file({k: sd[k].to(torch.bfloat16) for k in ks}, str(root / fname))  # bf16 on disk: converted
            wmap.update({k: fname for k in ks})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        return root / "model.safetensors.index.json"
    path = root / "own.safetensors"
    asyncio.run(dsio.checkpoint.save(sd, str(path)))
    return path


def _config(offload: str, root: str, world: int) -> dict[str, Any]:
    cfg = base_config(3, world=world, micro=2)
    if offload != "none":
        dev = {"device": offload, "nvme_path": root} if offload == "nvme" else {"device": offload}
        cfg["zero_optimization"]["offload_param"] = dev
        cfg["zero_optimization"]["offload_optimizer"] = dict(dev)
        cfg["zero_optimization"]["sub_group_size"] = 1 << 16
    return cfg


def _load_case(kind: str, offload: str, src: str) -> dict[str, Any]:
    with scratch_dir("pretrained-") as root:
        return _load_case_in(kind, offload, src, root)


def _load_case_in(kind: str, offload: str, src: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = _config(offload, root, world)
    want = _pretrained()
    if kind == "sharded":
        want = {k: v.to(torch.bfloat16).float() for k, v in want.items()}
    # reference: a whole model given the pretrained values, trained
    torch.manual_seed(0)
    ref = Tiny()
    ref.load_state_dict({**want, "head.weight": want["emb.weight"]})
    e = dstrain.initialize(model=ref, config=cfg)[0]
    ref_losses = engine_losses(e, STEPS)
    e.close()
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg):
        model = Tiny()
    report = load_pretrained(model, src)
    with GatheredParameters(list(model.parameters())):
        equal = all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    shard_bytes = sum(
        (p.numel() + world - 1) // world * (2 if kind == "sharded" else 4) for p in model.parameters()
    )
    e = dstrain.initialize(model=model, config=cfg)[0]
    losses = engine_losses(e, STEPS)
    e.close()
    return {
        "equal": equal,
        "losses": losses,
        "ref_losses": ref_losses,
        "bytes_read": report.bytes_read,
        "shard_bytes": shard_bytes,
        "missing": report.missing,
        "loaded": report.loaded,
    }


def _all(srcs: dict[str, str]) -> dict[str, Any]:
    return {
        (kind, off): _load_case(kind, off, srcs[kind])
        for kind, off in (("single", "none"), ("sharded", "cpu"), ("dsio", "nvme"))
    }


@pytest.fixture(scope="module")
def loaded2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    base = tmp_path_factory.mktemp("pre")
    srcs = {k: str(_write(k, base / k, _pretrained())) for k in ("single", "sharded", "dsio")}
    return spawn(_all, srcs, world=2, start_method="forkserver")


@pytest.mark.parametrize("case", [("single", "none"), ("sharded", "cpu"), ("dsio", "nvme")])
@pytest.mark.parametrize("rank", [0, 1])
def test_pretrained_values_reach_the_partitions(
    loaded2: list[dict[Any, Any]], case: tuple[str, str], rank: int
) -> None:
    out = loaded2[rank][case]
    assert out["equal"]  # gathered back: exactly the file's values (converted from bf16 where stored so)
    assert out["losses"] == out["ref_losses"]  # trains as the same model loaded whole
    assert out["missing"] == ()
    assert "emb.weight" in out["loaded"]
    # this rank read its shards' bytes only: about half of the model, not all of it
    assert out["bytes_read"] <= out["shard_bytes"] + 64


def test_plain_model_and_strict_errors(tmp_path: Path) -> None:
    sd = _pretrained()
    src = _write("single", tmp_path / "m", sd)
    torch.manual_seed(0)
    model = Tiny()
    report = load_pretrained(model, src)
    assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())
    assert report.bytes_read == sum(v.numel() * 4 for v in sd.values())
    # missing + unexpected + shape mismatch, all listed, nothing read
    bad = dict(sd)
    del bad["ln.weight"]
    bad["extra.bias"] = torch.zeros(3)
    bad["pos"] = torch.zeros(3, 3)
    _write("single", tmp_path / "bad", bad)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PretrainedMismatchError) as ei:
        load_pretrained(model, tmp_path / "bad")
    err = ei.value
    assert err.missing == ("ln.weight",) and err.unexpected == ("extra.bias",)
    assert err.mismatched == (("pos", (3, 3), tuple(model.pos.shape)),)
    assert isinstance(err, KeyError) and "ln.weight" in str(err)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    report = load_pretrained(model, tmp_path / "bad", strict=False)
    assert report.missing == ("ln.weight",) and report.unexpected == ("extra.bias",)
    assert torch.equal(model.ln.weight, before["ln.weight"]) and torch.equal(model.pos, before["pos"])
    assert torch.equal(model.emb.weight, sd["emb.weight"])


def test_refuses_engine_partitioned_models_and_bad_indexes(tmp_path: Path) -> None:
    src = _write("single", tmp_path / "m", _pretrained())
    e = dstrain.initialize(model=Tiny(), config=base_config(3, world=1, micro=2))[0]
    with pytest.raises(InitError):
        load_pretrained(e.module, src)
    e.close()
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"pos": "../escape.safetensors"}})
    )
    with pytest.raises(dsio.CheckpointFormatError):
        load_pretrained(Tiny(), idx)
    (idx / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(dsio.CheckpointFormatError):
        load_pretrained(Tiny(), idx)
    with pytest.raises(dsio.CheckpointNotFoundError):
        load_pretrained(Tiny(), tmp_path / "nothing")
    os.mkdir(tmp_path / "empty")
    with pytest.raises(dsio.CheckpointNotFoundError):
        load_pretrained(Tiny(), tmp_path / "empty")
