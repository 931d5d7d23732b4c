"""The optimizer side: building the torch optimizer, the `Stepper` the engine steps through, and
global-norm gradient clipping over any set of gradient groups."""

from dstrain.optim.build import ClientOptimizer, build_optimizer
from dstrain.optim.clip import GradSet, clip_grads_, global_grad_norm
from dstrain.optim.stepper import Stepper, StepperStatistics, TorchStepper

__all__ = [
    "ClientOptimizer",
    "GradSet",
    "Stepper",
    "StepperStatistics",
    "TorchStepper",
    "build_optimizer",
    "clip_grads_",
    "global_grad_norm",
]
