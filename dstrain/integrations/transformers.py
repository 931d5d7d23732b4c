"""The Hugging Face Trainer on dstrain: ``Trainer(model, args, ..., dstrain_config=...)``.

A subclass of `transformers.Trainer` (the only dstrain module that imports transformers; ``pip install
dsio[hf]``). Where HF's Trainer would hand a DeepSpeed config to DeepSpeed, this one hands it to
`dstrain.initialize`, after filling its ``"auto"`` values from `TrainingArguments` exactly as HF does
for DeepSpeed (`trainer_auto_values`: micro batch, accumulation, lr, betas, eps, weight decay, warmup
and total steps, fp16/bf16, ``max_grad_norm`` -> ``gradient_clipping``; bucket sizes from the model's
hidden size in `dstrain.initialize`). Without an ``"optimizer"`` section the Trainer's own optimizer (its
weight-decay param groups) is used; without a ``"scheduler"`` section, the Trainer's own schedule.

The engine does forward, backward, the optimizer step and the schedule (the Trainer's ``optimizer`` and
``lr_scheduler`` become views whose ``step`` does nothing); checkpoints go through
``engine.save_checkpoint`` / ``load_checkpoint`` (``train(resume_from_checkpoint=...)``); ``save_model``
writes Hugging Face-loadable weights gathered a unit at a time (``engine.save_16bit_model``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import transformers

import dstrain
from dstrain.config import read_config_file
from dstrain.config_auto import fill_auto
from dstrain.engine import Engine
from dstrain.errors import ConfigError

__all__ = ["Trainer", "trainer_auto_values"]

log = logging.getLogger(__name__)


def trainer_auto_values(args: transformers.TrainingArguments, num_training_steps: int) -> dict[str, Any]:
    """What HF's DeepSpeed integration fills ``"auto"`` with, by dotted config key
    (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``)."""
    return {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.world_size
        * args.per_device_train_batch_size
        * args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": args.learning_rate,
        "scheduler.params.warmup_num_steps": args.get_warmup_steps(num_training_steps),
        "scheduler.params.total_num_steps": num_training_steps,
        "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
        "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
    }


def _mismatches(config: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """Keys set (not "auto") in the config that disagree with TrainingArguments (HF refuses those too)."""
    out = []
    for path, value in values.items():
        node: Any = config
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None and node != "auto" and path.split(".")[0] not in ("scheduler",) and node != value:
            out.append(f"{path}={node!r} vs TrainingArguments {value!r}")
    return out


class _EngineModule(torch.nn.Module):
    """What the Trainer calls as ``model``: forwards through the engine (casts, ZeRO-3 gathers)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module  # a child: train()/eval()/parameters() reach the model
        self._engine = [engine]  # not an attribute nn.Module would register

    @property
    def engine(self) -> Engine:
        return self._engine[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine's ZeRO strategy clears gradients after every optimizer step."""


class _EngineOptimizer:
    """The Trainer's ``optimizer``: the engine steps; this shows its param groups and state."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.stepper.param_groups

    def step(self, closure: Any = None) -> None:
        """Nothing to do: `Trainer.training_step` stepped the engine at the accumulation boundary."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do (see `_EngineModule.zero_grad`)."""

    def state_dict(self) -> dict[str, Any]:
        return self.engine.stepper.state_dict()


class _EngineScheduler:
    """The Trainer's ``lr_scheduler``: the engine steps the real one; this reports the lr a step used."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last_lr = engine.get_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the engine steps its schedule after each applied optimizer step."""

    def get_last_lr(self) -> list[float]:
        return list(self.last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {}


class Trainer(transformers.Trainer):
    """`transformers.Trainer` training through a dstrain engine.

    ``dstrain_config``: a DeepSpeed config (dict, or a JSON/HJSON path) with ``"auto"`` where the
    Trainer's arguments should decide. Everything else is HF's Trainer: datasets, collators,
    callbacks, logging, evaluation and checkpoint rotation.
    """

    # Whether ``compute_loss`` already returns the loss scaled for gradient accumulation; None: derived as
    # the Trainer does. Declared here with HF's default because transformers before 5.2x has no such
    # attribute (5.17, the H200 machine's, raised AttributeError in training_step); a subclass or an
    # instance may set it on every version.
    loss_is_scaled_for_ga: bool | None = None

    def __init__(
        self, *args: Any, dstrain_config: Mapping[str, Any] | str | os.PathLike[str], **kwargs: Any
    ) -> None:
        self.dstrain_config = (
            read_config_file(dstrain_config)
            if isinstance(dstrain_config, str | os.PathLike)
            else dict(dstrain_config)
        )
        self.engine: Engine | None = None
        super().__init__(*args, **kwargs)

    # -- building the engine -----------------------------------------------------------------

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> Any:
        config = self.dstrain_config
        values = trainer_auto_values(self.args, max_steps)
        wrong = _mismatches(config, values)
        if wrong:
            raise ConfigError(
                wrong[0].split("=")[0], "the config disagrees with TrainingArguments: " + "; ".join(wrong)
            )
        config = fill_auto(config, values)
        optimizer: Any = None
        if "optimizer" not in config:  # the Trainer's AdamW with its weight-decay groups
            self.create_optimizer()
            optimizer = self.optimizer
        schedule: Any = None
        if "scheduler" not in config:  # the Trainer's schedule, over whichever optimizer the engine steps
            if optimizer is not None:
                self.lr_scheduler = None
                schedule = self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)
            else:

                def schedule(opt: Any) -> Any:
                    return self.create_scheduler(num_training_steps=max_steps, optimizer=opt)

        if self.engine is not None:
            self.engine.close()
        self.engine, _, _, _ = dstrain.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=schedule, config=config
        )
        if resume_from_checkpoint is not None:
            self.engine.load_checkpoint(resume_from_checkpoint)
        self.optimizer = _EngineOptimizer(self.engine)  # type: ignore[assignment]
        self.lr_scheduler = _EngineScheduler(self.engine)  # type: ignore[assignment]
        model = _EngineModule(self.engine)
        self.model_wrapped = model
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: Any = None
    ) -> torch.nn.Module:
        if self.engine is not None:  # evaluate / predict through the engine (ZeRO-3 gathers)
            return _EngineModule(self.engine)
        return super()._wrap_model(model, training, dataloader)

    # -- one micro-step ----------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        engine = self.engine
        if engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss: Any = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        # HF's normalisation: divided by the accumulation steps unless num_items_in_batch (or a custom
        # loss function) already made it the mean over the whole accumulated batch
        scaled = self.loss_is_scaled_for_ga  # set by a subclass or the caller; None: derive it
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        boundary = bool(self.accelerator.gradient_state.sync_gradients)  # the Trainer's own count decides
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            assert isinstance(self.lr_scheduler, _EngineScheduler)
            self.lr_scheduler.last_lr = engine.get_lr()  # what this optimizer step runs at
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()  # clipped inside the engine's step (gradient_clipping)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()

    # -- checkpoints and saving --------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)  # every rank: partitions, optimizer, schedule, RNG, counters
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        return None  # engine.load_checkpoint restored them in _prepare_for_training

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Weights Hugging Face's ``from_pretrained`` loads (``model.safetensors`` in the compute dtype,
        gathered a unit at a time onto rank 0), with the config, processing class and arguments. At
        ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save`` it saves a dstrain checkpoint
        instead (export it with ``dstrain export``), as HF does with DeepSpeed. Call it on every rank."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        directory: str = output_dir if output_dir is not None else str(self.args.output_dir)
        os.makedirs(directory, exist_ok=True)
        if not self.engine.save_16bit_model(directory, "model.safetensors"):
            log.warning(
                "stage3_gather_16bit_weights_on_model_save is false: saving a dstrain checkpoint in %s instead "
                "(dstrain export turns it into HF weights)",
                directory,
            )
            self.engine.save_checkpoint(directory)
        if not self.args.should_save:
            return None
        model: Any = self.model
        model.config.save_pretrained(directory)
        if isinstance(model, transformers.PreTrainedModel) and model.can_generate():  # then it carries one
            model.generation_config.save_pretrained(directory)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)
        torch.save(self.args, os.path.join(directory, "training_args.bin"))
        return None
