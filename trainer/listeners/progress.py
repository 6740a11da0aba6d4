"""The tqdm progress bar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import attrs
import torch

from trainer import validators

__all__ = ["ProgressBar"]


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ProgressBar needs tqdm: pip install 'renate-events[progress]' (or pip install tqdm)"
        ) from exc
    return tqdm


@attrs.define(eq=False)
class ProgressBar:
    """A tqdm progress bar per epoch with the loss, refreshed every ``log_every_n_steps``.

    The loss is read as a Python number only every ``log_every_n_steps`` batches, so the bar adds
    no device synchronisation to the other steps. The bar is silent when the output is not a
    terminal (tqdm's ``disable=None``) unless ``always`` is set.

    Args:
        description: Text in front of each bar (e.g. the task's name).
        log_every_n_steps: How often the loss shown is refreshed.
        always: Show the bar even when the output is not a terminal.
        leave: Keep finished bars on screen.

    Raises:
        ImportError: When tqdm is not installed.
        ValueError: When ``log_every_n_steps`` is not an int >= 1.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> trainer.subscribe(ProgressBar(description="task 1"))
        'progress_bar_0'
    """

    runs_on: ClassVar[str] = "rank_zero"
    """Where it runs in a distributed fit (see :data:`trainer.distributed.RUNS_ON`)."""

    description: str = ""
    log_every_n_steps: int = attrs.field(default=10, validator=validators.int_at_least(1))
    always: bool = False
    leave: bool = False
    _total: int | None = attrs.field(init=False, default=None)
    _bar: Any = attrs.field(init=False, default=None)
    _factory: Any = attrs.field(init=False, factory=_tqdm)

    def on_train_start(self, train_loader: Iterable[Any]) -> None:
        try:
            self._total = len(train_loader)  # type: ignore[arg-type]
        except TypeError:
            self._total = None

    def on_epoch_start(self, state: Any) -> None:
        self._close()
        epochs = f"/{state.max_epochs}" if state.max_epochs else ""
        prefix = f"{self.description} " if self.description else ""
        self._bar = self._factory(
            total=self._total,
            desc=f"{prefix}epoch {state.epoch + 1}{epochs}",
            disable=False if self.always else None,
            leave=self.leave,
            unit="batch",
        )

    def on_batch_end(self, state: Any, loss: Any) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if state.global_step % self.log_every_n_steps == 0:
            value = loss.detach() if isinstance(loss, torch.Tensor) else loss
            self._bar.set_postfix(loss=f"{float(value):.4f}", refresh=False)

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in metrics.items()}, refresh=True)

    def on_train_end(self) -> None:
        self._close()

    def on_exception(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
