"""`Monitor`: after each optimizer step, DeepSpeed's training events to every enabled writer (rank 0).

Events (DeepSpeed's names; the step axis is the global sample count, ``global_steps x train_batch_size``):

- ``Train/Samples/train_loss``: the mean of the step's micro-step losses (rank 0's)
- ``Train/Samples/lr``: the first param group's learning rate
- ``Train/Samples/loss_scale``: with fp16
- with ``wall_clock_breakdown``: ``Train/Samples/elapsed_time_ms_forward`` / ``_backward`` / ``_step``
  (this step's milliseconds in each phase)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstrain.monitor.writers import Event, Writer

if TYPE_CHECKING:
    from dstrain.engine import Engine

__all__ = ["Monitor"]


class Monitor:
    """A `dstrain.engine.StepObserver` that writes the events of each step to its writers."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers
        self._last = (0.0, 0.0, 0.0)

    def events(self, engine: Engine) -> list[Event]:
        s = engine.statistics()
        step = s.global_steps * engine.config.train_batch_size
        events: list[Event] = [
            ("Train/Samples/train_loss", s.last_loss, step),
            ("Train/Samples/lr", s.lr[0] if s.lr else float("nan"), step),
        ]
        if engine.config.fp16.enabled:
            events.append(("Train/Samples/loss_scale", s.loss_scale, step))
        if engine.config.wall_clock_breakdown:
            now = (s.forward_seconds, s.backward_seconds, s.step_seconds)
            for phase, t, before in zip(("forward", "backward", "step"), now, self._last, strict=True):
                events.append((f"Train/Samples/elapsed_time_ms_{phase}", (t - before) * 1e3, step))
            self._last = now
        return events

    def after_step(self, engine: Engine) -> None:
        events = self.events(engine)
        for w in self.writers:
            w.write_events(events)

    def close(self) -> None:
        for w in self.writers:
            w.close()
