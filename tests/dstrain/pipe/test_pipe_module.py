"""PipelineModule, LayerSpec, TiedLayerSpec and the partition methods (no process group: stage_id given)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from dstrain.pipe.errors import PartitionError
from dstrain.pipe.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_layers,
    partition_uniform,
)

BUILT: list[tuple[str, str]] = []  # (class, device of its first parameter) of every real construction


class Counted(nn.Linear):
    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        BUILT.append((type(self).__name__, str(self.weight.device)))


class Block(Counted):
    pass


class Emb(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim))
        BUILT.append(("Emb", str(self.weight.device)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx]


def head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


def test_partition_uniform_matches_deepspeed_split() -> None:
    assert partition_uniform(7, 2) == [0, 4, 7]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


def test_partition_balanced_minimises_heaviest_part() -> None:
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1, 11]  # 10 | 10
    weights = [5, 5, 5, 1, 1, 1, 1, 1]
    parts = partition_balanced(weights, 3)
    loads = [sum(weights[parts[p] : parts[p + 1]]) for p in range(3)]
    assert max(loads) == 10 and min(loads) == 5  # the best max, then the best min
    assert all(parts[p] < parts[p + 1] for p in range(3))  # no empty stage
    with pytest.raises(PartitionError):
        partition_balanced([1, 2], 3)


def test_partition_by_parameters_builds_nothing_real() -> None:
    BUILT.clear()
    layers = [
        LayerSpec(Counted, 64, 64),
        LayerSpec(Counted, 8, 8),
        LayerSpec(Counted, 8, 8),
        LayerSpec(Counted, 64, 64),
    ]
    parts = partition_layers(layers, 2, "parameters")
    assert parts == [0, 2, 4]  # 4160+72 | 72+4160
    assert BUILT and all(dev == "meta" for _, dev in BUILT)


def test_partition_by_type_regex() -> None:
    layers = [
        LayerSpec(Counted, 4, 4),
        *[LayerSpec(Block, 4, 4) for _ in range(4)],
        nn.ReLU(),
        LayerSpec(Counted, 4, 4),
    ]
    assert partition_layers(layers, 2, "type:block") == [
        0,
        3,
        7,
    ]  # two Blocks on each stage (case-insensitive)
    with pytest.raises(PartitionError):
        partition_layers(layers, 2, "type:Nothing")
    with pytest.raises(PartitionError):
        partition_layers(layers, 2, "type:[")
    with pytest.raises(PartitionError):
        partition_layers(layers, 2, "bogus")
    with pytest.raises(PartitionError):
        partition_layers(layers[:1], 2, "uniform")


def _layers() -> list[object]:
    return [
        TiedLayerSpec("emb", Emb, 16, 8),
        LayerSpec(Block, 8, 8),
        torch.tanh,
        LayerSpec(Block, 8, 8),
        nn.Tanh(),
        LayerSpec(Block, 8, 8),
        TiedLayerSpec("emb", Emb, 16, 8, forward_fn=head),
    ]


def test_partition_by_type_names_a_function_by_its_own_name() -> None:
    # a plain function, a builtin and a method descriptor are matched by their own names; any other
    # callable (functools.partial) by its class, as DeepSpeed's type: partitioning sees them
    layers = [
        LayerSpec(Block, 4, 4),
        torch.relu,
        (lambda x: x * 2),
        torch.Tensor.tanh,
        functools.partial(torch.clamp, min=0.0),
        LayerSpec(Block, 4, 4),
    ]
    for found in ("type:^relu$", "type:lambda", "type:^tanh$", "type:^partial$"):
        partition_layers(layers, 1, found)  # a layer matches: no PartitionError
    for missing in ("type:builtin_function", "type:method_descriptor", "type:^function$", "type:clamp"):
        with pytest.raises(PartitionError):
            partition_layers(layers, 1, missing)


def test_only_local_layers_are_built() -> None:
    BUILT.clear()
    stage1 = PipelineModule(_layers(), num_stages=2, partition_method="uniform", seed_layers=True, stage_id=1)
    assert stage1.parts == [0, 4, 7]
    real = [name for name, dev in BUILT if dev != "meta"]
    assert real == ["Block", "Emb"]  # layer 5 and the tied embedding: nothing of stage 0
    assert set(stage1.state_dict()) == {"5.weight", "5.bias", "tied_modules.emb.weight"}
    assert stage1.tied_stages() == {"emb": [0, 1]}
    assert stage1.tied_weights("emb") == [stage1.tied_modules["emb"].weight]


def test_stages_compose_to_the_whole_model_and_seeded_ties_agree() -> None:
    whole = PipelineModule(_layers(), num_stages=1, seed_layers=True, stage_id=0)
    parts = [
        PipelineModule(_layers(), num_stages=3, partition_method="uniform", seed_layers=True, stage_id=s)
        for s in range(3)
    ]
    # seeded builds: every layer's weights are independent of the partitioning
    for p in parts:
        for k, v in p.state_dict().items():
            assert torch.equal(v, whole.state_dict()[k]), k
    assert torch.equal(parts[0].tied_modules["emb"].weight, parts[2].tied_modules["emb"].weight)
    idx = torch.randint(0, 16, (4, 5))
    x = idx
    for p in parts:
        x = p(x)
    assert torch.equal(x, whole(idx))  # (4, 5, 16) logits


def test_activation_checkpointing_same_gradients_less_saved() -> None:
    def build(interval: int) -> PipelineModule:
        layers = [LayerSpec(Block, 32, 32) if i % 2 == 0 else nn.GELU() for i in range(8)]
        return PipelineModule(
            layers, num_stages=1, seed_layers=True, activation_checkpoint_interval=interval, stage_id=0
        )

    x = torch.randn(64, 32)
    grads = []
    saved = []
    for interval in (0, 2):
        model = build(interval)
        n_saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal n_saved
            n_saved += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        saved.append(n_saved)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert saved[1] < saved[0] / 2  # only each 2-layer run's input is kept


def test_bad_arguments() -> None:
    with pytest.raises(TypeError):
        LayerSpec(int)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PipelineModule([object()], num_stages=1, stage_id=0)
    with pytest.raises(PartitionError):
        PipelineModule([], num_stages=1)
    with pytest.raises(PartitionError):
        PipelineModule(_layers(), num_stages=0, stage_id=0)
    with pytest.raises(PartitionError):
        PipelineModule(_layers(), num_stages=2, stage_id=2)
    with pytest.raises(ValueError):
        PipelineModule(_layers(), num_stages=1, activation_checkpoint_interval=-1, stage_id=0)
    with pytest.raises(ValueError):
        TiedLayerSpec("k", Emb, 2, 2, tied_weight_attr=[])


def test_runner_checks_the_layout_of_a_checkpoint() -> None:
    """The runner's checkpoint part: state saved by another split (or stage count) is refused on load."""
    from dstrain.pipe.errors import PipelineError
    from dstrain.pipe.runner import PipelineRunner

    def runner(method: str) -> PipelineRunner:
        module = PipelineModule(_layers(), num_stages=1, partition_method=method, stage_id=0)
        return PipelineRunner(
            module=module, engine=None, micro_batches=2, pp_ranks=[0], pp_group=None, dp_size=1
        )

    saved = runner("uniform").state_dict()
    runner("parameters").load_state_dict(saved)  # one stage: same split whatever the method
    other = dict(saved, parts=[0, 3, 7], stages=2)
    with pytest.raises(PipelineError):
        runner("uniform").load_state_dict(other)


def test_module_under_a_launcher_without_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets WORLD_SIZE; building a 2-stage module before init_process_group would build stage 0 on
    every rank (and fail later with a raw gloo error): refused at once, naming the fix."""
    import torch.distributed as dist

    from dstrain.pipe import ProcessGroupMissingError

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ProcessGroupMissingError):
        PipelineModule([LayerSpec(nn.Linear, 4, 4) for _ in range(2)], num_stages=2)
    PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1)  # one stage: nothing to split
