"""Run under torchrun (2 gloo ranks) by tests/dstrain/integrations/test_hf_trainer.py: the same HF Trainer run plain
(DDP) and through dstrain (ZeRO-2; ZeRO-3 with parameters and optimizer state on NVMe), a resume from
the dstrain run's checkpoint, and save_model -> from_pretrained. Writes rank-<r>.json into argv[1]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _hf_models import VOCAB, tiny_gpt2, tiny_llama
from transformers import GPT2LMHeadModel, LlamaForCausalLM, TrainingArguments
from transformers import Trainer as HFTrainer

from dstrain.integrations.transformers import Trainer

OUT = Path(sys.argv[1])
STEPS = 4


class Tokens(torch.utils.data.Dataset):
    """Deterministic token sequences (labels = inputs: causal LM)."""

    def __init__(self, n: int = 32, seq: int = 8, vocab: int = VOCAB) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def gpt2() -> GPT2LMHeadModel:
    return tiny_gpt2(positions=16)


def llama() -> LlamaForCausalLM:
    return tiny_llama(positions=16)


def arguments(out: str, **extra: object) -> TrainingArguments:
    kwargs: dict = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=7,
    )
    kwargs.update(extra)
    return TrainingArguments(**kwargs)


def losses(trainer: HFTrainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
}


def main() -> None:
    rank = int(os.environ["RANK"])
    nvme = OUT / f"nvme-{rank}"
    result: dict = {}

    ref = HFTrainer(model=gpt2(), args=arguments(str(OUT / "ref-gpt2")), train_dataset=Tokens())
    ref.train()
    result["ref_gpt2"] = losses(ref)
    zero2 = Trainer(
        model=gpt2(),
        args=arguments(str(OUT / "zero2")),
        train_dataset=Tokens(),
        dstrain_config={**AUTO, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
    )
    zero2.train()
    result["zero2"] = losses(zero2)
    result["zero2_eval"] = zero2.evaluate(eval_dataset=Tokens(8))["eval_loss"]
    result["ref_eval"] = ref.evaluate(eval_dataset=Tokens(8))["eval_loss"]

    ref3 = HFTrainer(model=llama(), args=arguments(str(OUT / "ref-llama")), train_dataset=Tokens())
    ref3.train()
    result["ref_llama"] = losses(ref3)
    zero3_config = {
        **AUTO,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
        },
    }
    run3 = OUT / "zero3"
    zero3 = Trainer(
        model=llama(),
        args=arguments(str(run3), save_strategy="steps", save_steps=2),
        train_dataset=Tokens(),
        dstrain_config=zero3_config,
    )
    zero3.train()
    result["zero3"] = losses(zero3)

    resumed = Trainer(
        model=llama(),
        args=arguments(str(OUT / "zero3-resumed")),
        train_dataset=Tokens(),
        dstrain_config={
            **zero3_config,
            "zero_optimization": {
                **zero3_config["zero_optimization"],
                "offload_param": {"device": "nvme", "nvme_path": str(nvme) + "-r"},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme) + "-r"},
            },
        },
    )
    resumed.train(resume_from_checkpoint=str(run3 / "checkpoint-2"))
    result["resumed"] = losses(resumed)

    final = OUT / "final"
    zero3.save_model(str(final))
    full = zero3.engine.full_state_dict()
    dist.barrier()
    if rank == 0:
        loaded = LlamaForCausalLM.from_pretrained(str(final))
        state = loaded.state_dict()
        result["from_pretrained_equal"] = all(torch.equal(state[k], v) for k, v in full.items())
        result["from_pretrained_keys"] = sorted(set(full) ^ set(state))
        result["saved_files"] = sorted(os.listdir(final))
    (OUT / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
