"""HF ``generate`` on a ZeRO-3 engine's module across 2 gloo ranks: different prompt lengths per rank,
one rank reaching EOS early, greedy decoding. Every forward gathers parameters with collectives, so
the ranks must run the same number of forwards: ``synced_gpus=True`` does that, and a dstrain ZeRO-3
model defaults to it (as HF does under DeepSpeed ZeRO-3). The tokens equal the unpartitioned model's."""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
import threading
from typing import Any

import pytest
import torch
from _dstrain_helpers import spawn

# found, not imported: a collection that does not run these tests skips the ~2.5 CPU-s import
if importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra (transformers) is not installed", allow_module_level=True)

MAX_NEW = 10
#: A rank still generating after this many seconds is taken as hung (the whole case takes ~1 s).
HUNG_AFTER = 240.0
PROMPTS = ([[5, 9, 1]], [[7, 3, 3, 8, 2, 11]])  # rank 0's and rank 1's: different lengths


def _model(kind: str) -> torch.nn.Module:
    from _hf_models import tiny_gpt2, tiny_llama  # imports transformers: after the find_spec check

    build = tiny_gpt2 if kind == "gpt2" else tiny_llama
    return build(positions=32, initializer_range=0.5).eval()


def _eos(ref: torch.nn.Module) -> int:
    """A token rank 0's greedy continuation reaches early and rank 1's never does (the same on every
    rank: each holds the same whole reference model)."""
    conts = []
    with torch.no_grad():
        for p in PROMPTS:
            prompt = torch.tensor(p)
            out: Any = ref.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            conts.append(out[0, prompt.shape[1] :].tolist())
    return next(t for t in conts[0][1 : MAX_NEW // 2] if t not in conts[1])


def _generate(kind: str, offload: str) -> dict[str, Any]:
    import torch.distributed as dist

    import dstrain

    rank = dist.get_rank()
    root = tempfile.mkdtemp(prefix="gen-", dir=os.environ.get("DSTRAIN_TEST_NVME"))
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": root}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": root}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    try:
        model = _model(kind)
        ref = copy.deepcopy(model)  # whole, on every rank
        eos = _eos(ref)
        prompt = torch.tensor(PROMPTS[rank])
        kw = {"max_new_tokens": MAX_NEW, "do_sample": False, "eos_token_id": eos, "pad_token_id": eos}
        with torch.no_grad():
            want = ref.generate(prompt, **kw)
        engine = dstrain.initialize(model=model, config=cfg)[0]
        out: dict[str, Any] = {"want": want.tolist(), "eos": eos}
        with torch.no_grad():
            for synced in (True, None):  # passed, and left to the default
                got: Any = engine.module.generate(prompt, synced_gpus=synced, **kw)
                out[f"synced={synced}"] = got.tolist()
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _all() -> dict[str, Any]:
    # a rank left waiting in a gather would wait for gloo's 30-minute timeout: fail long before
    watchdog = threading.Timer(HUNG_AFTER, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    try:
        return {f"{kind}-{offload}": _generate(kind, offload) for kind, offload in CASES}
    finally:
        watchdog.cancel()


CASES = (("gpt2", "none"), ("llama", "nvme"))


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return spawn(_all, world=2, start_method="forkserver")


@pytest.mark.parametrize("case", [f"{k}-{o}" for k, o in CASES])
@pytest.mark.parametrize("synced", ["synced=True", "synced=None"])
def test_generation_matches_the_whole_model(world2: list[dict[str, Any]], case: str, synced: str) -> None:
    r0, r1 = world2[0][case], world2[1][case]
    # the case is what it claims: rank 0 stops at EOS, rank 1 runs its whole budget, longer prompt
    assert r0["want"][0][-1] == r0["eos"] and r0["eos"] not in r0["want"][0][len(PROMPTS[0][0]) : -1]
    assert len(r1["want"][0]) == len(PROMPTS[1][0]) + MAX_NEW
    assert len(set(r1["want"][0][len(PROMPTS[1][0]) :])) > 1  # not one token repeated
    assert r0[synced] == r0["want"]
    assert r1[synced] == r1["want"]


def test_default_synced_gpus_fills_only_what_the_caller_left_out() -> None:
    from dstrain.integrations.generation import default_synced_gpus

    class Generative(torch.nn.Module):
        def generate(self, inputs: Any = None, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
            return synced_gpus, kwargs

    model = Generative()
    assert default_synced_gpus(model)
    assert model.generate(1, max_new_tokens=2) == (True, {"max_new_tokens": 2})
    assert model.generate(1, synced_gpus=None)[0] is True
    assert model.generate(1, synced_gpus=False)[0] is False  # an explicit choice is kept
    assert not default_synced_gpus(torch.nn.Linear(2, 2))  # nothing to wrap
