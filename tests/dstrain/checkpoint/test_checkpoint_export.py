"""Export without the job: a checkpoint of any world size and stage becomes Hugging Face safetensors files
(one shard or several + index), a consolidated state dict, or weights loaded into a plain model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _dstrain_helpers import global_batch, spawn
from _reshape_workers import make_untied, train_and_save

import dstrain
from dstrain.checkpoint import consolidated_state_dict, export, load_state_dict_from_checkpoint

safetensors = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def stage3_world2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    ckpt = tmp_path_factory.mktemp("export") / "ck"
    results = spawn(train_and_save, str(ckpt), 3, world=2, start_method="forkserver")
    return ckpt, results[0]["state"]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    idx, _ = global_batch(0, 4)
    with torch.no_grad():
        return model.logits(idx)


def test_export_loads_strictly_into_a_fresh_model_with_the_same_logits(stage3_world2, tmp_path: Path) -> None:
    ckpt, trained = stage3_world2
    files = export(ckpt, tmp_path / "hf", progress=False)
    assert files == [tmp_path / "hf" / "model.safetensors"]
    sd = safetensors.load_file(str(files[0]))
    assert set(sd) == set(trained)  # the module's own names, buffers included
    reference, fresh = make_untied(), make_untied(seed=5)
    reference.load_state_dict(trained)
    fresh.load_state_dict(sd, strict=True)
    assert torch.equal(_logits(fresh), _logits(reference))
    with open(files[0], "rb") as f:  # Hugging Face's loaders check the header's "format"
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"]["format"] == "pt"


def test_consolidated_state_dict_and_load_into_a_model(stage3_world2) -> None:
    ckpt, trained = stage3_world2
    sd = consolidated_state_dict(ckpt)
    assert set(sd) == set(trained) and all(torch.equal(sd[k], trained[k]) for k in trained)
    half = consolidated_state_dict(ckpt, dtype="bf16")
    assert half["emb.weight"].dtype == torch.bfloat16
    assert torch.equal(half["emb.weight"], trained["emb.weight"].bfloat16())
    model = load_state_dict_from_checkpoint(make_untied(seed=9), ckpt)
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    with pytest.raises(dstrain.CheckpointMismatchError) as e:
        load_state_dict_from_checkpoint(make_untied(dim=8), ckpt)
    assert "emb.weight" in e.value.reshaped


def test_sharded_export_with_index(stage3_world2, tmp_path: Path) -> None:
    ckpt, trained = stage3_world2
    files = export(ckpt, tmp_path, max_shard_size="1KB", dtype="fp16", progress=False)
    shards, index = files[:-1], files[-1]
    assert len(shards) > 1 and index.name == "model.safetensors.index.json"
    assert [p.name for p in shards] == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    meta = json.loads(index.read_text())
    assert set(meta["weight_map"]) == set(trained)
    got: dict[str, torch.Tensor] = {}
    for p in shards:
        part = safetensors.load_file(str(p))
        assert all(meta["weight_map"][k] == p.name for k in part)
        got.update(part)
        # a shard holds at most max_shard_size, unless it is one tensor bigger than that
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 1000
    assert meta["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert all(got[k].dtype == torch.float16 and torch.equal(got[k], trained[k].half()) for k in trained)


def test_tied_weights_are_written_once(tmp_path: Path) -> None:
    trained = train_and_save(str(tmp_path / "ck"), 1, tied=True)["state"]
    assert torch.equal(trained["head.weight"], trained["emb.weight"])
    sd = safetensors.load_file(str(export(tmp_path / "ck", tmp_path / "hf", progress=False)[0]))
    assert "emb.weight" in sd and "head.weight" not in sd  # Hugging Face re-ties them at load
    whole = consolidated_state_dict(tmp_path / "ck")
    assert whole["head.weight"] is whole["emb.weight"]


def test_cli(stage3_world2, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dstrain.cli import main

    ckpt, trained = stage3_world2
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--dtype", "bf16", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "model.safetensors")
    sd = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sd["head.weight"].dtype == torch.bfloat16
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "o2")]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err


def test_export_with_a_missing_rank_file_names_the_rank_and_file(stage3_world2, tmp_path: Path) -> None:
    import shutil

    ckpt, _ = stage3_world2
    broken = tmp_path / "ck"
    shutil.copytree(ckpt, broken)
    victim = next(broken.glob("step-*/rank-00001.safetensors"))
    victim.unlink()
    with pytest.raises(dstrain.CheckpointRankError) as e:
        export(broken, tmp_path / "out", progress=False)
    assert e.value.rank == 1 and str(victim) in str(e.value)


_RSS_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from dstrain.checkpoint import export
    def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    export(sys.argv[1], sys.argv[2] + "/warm", max_shard_size=sys.argv[3], progress=False)  # pools, imports
    before = peak()
    export(sys.argv[1], sys.argv[2] + "/out", max_shard_size=sys.argv[3], progress=False)
    print(peak() - before)
    """
)


def test_export_memory_is_bounded_by_one_shard(tmp_path: Path) -> None:
    depth, dim = 24, 256  # 24 x 256 x 256 fp32: 6.3 MB of weights, far above the 1 MB shards
    train_and_save(str(tmp_path / "ck"), 1, steps=1, depth=depth, dim=dim)
    model_bytes = depth * dim * dim * 4
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "ck"), str(tmp_path), "1MB"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    grown = int(out.stdout.strip().splitlines()[-1])
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) >= 6
    # the second export grew the peak by less than half the model: what was in memory was about a shard
    assert grown < model_bytes / 2, (grown, model_bytes)


def test_save_16bit_model_gathers_stage3_weights_when_the_config_asks(tmp_path: Path) -> None:
    from _reshape_workers import online_exports

    both = spawn(online_exports, str(tmp_path), 3, world=2, start_method="forkserver")
    on, off = [r["on"] for r in both], [r["off"] for r in both]
    assert [r["saved"] for r in on] == [True, True] and on[0]["flag"]
    sd = safetensors.load_file(str(tmp_path / "on" / "model.safetensors"))
    assert set(sd) == set(on[0]["state"]) and all(torch.equal(sd[k], on[0]["state"][k]) for k in sd)
    assert [r["saved"] for r in off] == [False, False] and not off[0]["flag"]
    assert not (tmp_path / "off").exists()


def test_save_16bit_model_below_stage3_in_the_compute_dtype(tmp_path: Path) -> None:
    from _reshape_workers import online_export

    r = online_export(str(tmp_path), 1, False, bf16=True)
    assert r["saved"]
    sd = safetensors.load_file(str(tmp_path / "model.safetensors"))
    assert sd["emb.weight"].dtype == torch.bfloat16 and torch.equal(
        sd["emb.weight"], r["state"]["emb.weight"]
    )
    fresh = make_untied(seed=4)
    fresh.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)


def test_from_pretrained_of_the_export_equals_the_trained_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from _dstrain_helpers import base_config

    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    engine, _, _, _ = dstrain.initialize(
        model=transformers.GPT2LMHeadModel(cfg), config=base_config(3, world=1)
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    trained = engine.full_state_dict()
    engine.close()
    export(tmp_path / "ck", tmp_path / "hf", progress=False)
    cfg.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    reference = transformers.GPT2LMHeadModel(cfg).eval()
    reference.load_state_dict(trained)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # re-tied
    ids = torch.randint(0, 64, (2, 16), generator=g)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert not torch.equal(
        reference.transformer.wte.weight, transformers.GPT2LMHeadModel(cfg).transformer.wte.weight
    )
