"""Periodic, last and best checkpoints, keeping the last K."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs

from trainer import validators
from trainer.files import fsync_file, fsync_folder
from trainer.listeners._common import (
    INT_AT_LEAST_1_OR_NONE,
    METRIC_NAME,
    after_pending_saves,
    improved,
    monitored,
)
from trainer.state import rank_path

__all__ = ["ModelCheckpoint"]


_SUFFIX = ".safetensors"


def _check_filename(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    problem = None
    if not isinstance(value, str) or not value:
        problem = "is not a non-empty string"
    else:
        try:
            name = value.format(epoch=0, step=0)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            problem = f"does not format with only {{epoch}} and {{step}} ({exc!r})"
        else:
            if "/" in name or os.sep in name or (os.altsep and os.altsep in name):
                problem = "holds a path separator (put folders into dirpath)"
            elif name in ("best", "last") or name.startswith("."):
                problem = "clashes with best/last or hidden temporary files"
    if problem is not None:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a file name pattern with the "
            f"fields {{epoch}} and {{step}} and no suffix, like 'epoch={{epoch}}-step={{step}}'; "
            f"got {value!r}, which {problem}"
        )


def _replace_with_copy_of(source: str, target: str) -> None:
    """Make ``target`` hold the bytes of ``source`` atomically: a hard link, else a copy."""
    folder = os.path.dirname(target)
    temporary = os.path.join(folder, f".{os.path.basename(target)}.{uuid.uuid4().hex}.tmp")
    try:
        try:
            os.link(source, temporary)
        except OSError:  # no hard links on this file system
            shutil.copyfile(source, temporary)
            fsync_file(temporary)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    fsync_folder(folder)  # the rename itself survives a power loss


@attrs.define(eq=False)
class ModelCheckpoint:
    """Saves the whole training state periodically, at the end, and whenever a metric improves.

    Every ``every_n_steps`` batches and/or every ``every_n_epochs`` epochs it writes
    ``dirpath/<filename>.safetensors`` with :meth:`Trainer.save_checkpoint` (atomic; written once
    every listener has handled the event) and keeps the last ``keep_last`` of these periodic
    files, deleting older ones only after the new one is on disk. With ``save_last``,
    ``last.safetensors`` is the newest periodic file (a hard link, else a copy) and is written at
    every ``train_end``. With ``monitor``, ``best.safetensors`` is written at each validation
    that improves the metric. The list of kept files and the best score are stored in every
    checkpoint, so a resumed run keeps counting and deleting where it left off.

    Files it did not write are never deleted. Periodic names repeat across fits of one trainer
    (``step`` restarts with every fit), so use a ``dirpath`` per fit to keep them apart.

    Args:
        dirpath: The folder of the checkpoints; created if missing.
        every_n_steps: Save after every n-th training batch (global step), or None.
        every_n_epochs: Save after every n-th epoch, or None.
        monitor: A validation metric (``"val_loss"``) whose best value gets ``best.safetensors``.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher ``monitor`` is better.
        save_last: Keep ``last.safetensors`` up to date.
        keep_last: How many periodic files to keep (None: all; 0: none, only last and best).
        filename: Pattern of the periodic files' names, with ``{epoch}`` (0-based) and ``{step}``
            (the global step), without the suffix.

    Raises:
        ValueError: When an argument is out of range, or the combination saves nothing.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer(max_epochs=10)
        >>> trainer.subscribe(ModelCheckpoint("ckpt", monitor="val_loss", keep_last=2))
        'model_checkpoint_0'
    """

    runs_on: ClassVar[str] = "collective"
    """Where it runs in a distributed fit (see :data:`trainer.distributed.RUNS_ON`)."""

    dirpath: str = attrs.field(converter=os.fspath)
    every_n_steps: int | None = attrs.field(default=None, validator=INT_AT_LEAST_1_OR_NONE)
    every_n_epochs: int | None = attrs.field(default=1, validator=INT_AT_LEAST_1_OR_NONE)
    monitor: str | None = attrs.field(
        default=None, validator=validators.non_empty_string(METRIC_NAME, optional=True)
    )
    mode: str = attrs.field(default="min", validator=validators.one_of("min", "max"))
    save_last: bool = attrs.field(default=True, validator=validators.boolean)
    keep_last: int | None = attrs.field(
        default=3, validator=validators.int_at_least(0, optional=True)
    )
    filename: str = attrs.field(default="epoch={epoch}-step={step}", validator=_check_filename)
    _kept: list[str] = attrs.field(init=False, factory=list, repr=False)
    _best_score: float | None = attrs.field(init=False, default=None, repr=False)
    _best_step: int | None = attrs.field(init=False, default=None, repr=False)
    _validated: bool = attrs.field(init=False, default=False, repr=False)

    def __attrs_post_init__(self) -> None:
        periodic = (self.every_n_steps or self.every_n_epochs) and self.keep_last != 0
        if not (periodic or self.save_last or self.monitor):
            raise ValueError(
                f"ModelCheckpoint would save nothing: every_n_steps={self.every_n_steps!r}, "
                f"every_n_epochs={self.every_n_epochs!r}, keep_last={self.keep_last!r}, "
                f"save_last={self.save_last!r}, monitor={self.monitor!r}; enable one of them"
            )

    @property
    def kept(self) -> list[str]:
        """Paths of the periodic checkpoints kept now, oldest first."""
        return [os.path.join(self.dirpath, name) for name in self._kept]

    @property
    def best_score(self) -> float | None:
        """The best ``monitor`` value so far, or None."""
        return self._best_score

    @property
    def best_step(self) -> int | None:
        """The global step of the best checkpoint, or None."""
        return self._best_step

    @property
    def best_model_path(self) -> str:
        """Where the best checkpoint is written (it exists once ``best_score`` is set)."""
        return os.path.join(self.dirpath, "best" + _SUFFIX)

    @property
    def last_model_path(self) -> str:
        """Where the last checkpoint is written."""
        return os.path.join(self.dirpath, "last" + _SUFFIX)

    def on_train_start(self) -> None:
        self._validated = False

    def on_batch_end(self, trainer: Any, state: Any) -> None:
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._save_periodic(trainer, state)

    def on_epoch_end(self, trainer: Any, state: Any) -> None:
        if self.every_n_epochs and (state.epoch + 1) % self.every_n_epochs == 0:
            self._save_periodic(trainer, state)

    def on_validation_end(self, trainer: Any, state: Any, metrics: Mapping[str, float]) -> None:
        if self.monitor is None:
            return
        self._validated = True
        value = monitored(self, self.monitor, metrics)
        if improved(value, self._best_score, self.mode, 0.0):
            self._best_score, self._best_step = value, state.global_step
            trainer.save_checkpoint(self.best_model_path)

    def on_train_end(self, trainer: Any) -> None:
        if self.save_last:
            trainer.save_checkpoint(self.last_model_path)
        if self.monitor is not None and not self._validated:
            warnings.warn(
                f"ModelCheckpoint(monitor={self.monitor!r}) saw no validation in this fit, so "
                "no best checkpoint was written; pass val_loader= to fit()",
                stacklevel=2,
            )

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        checkpoint["kept"] = list(self._kept)
        checkpoint["best_score"] = self._best_score
        checkpoint["best_step"] = self._best_step

    def on_load_checkpoint(self, checkpoint: Any) -> None:
        self._kept = [str(name) for name in checkpoint["kept"]]
        best = checkpoint["best_score"]
        self._best_score = None if best is None else float(best)
        self._best_step = checkpoint["best_step"]

    def _save_periodic(self, trainer: Any, state: Any) -> None:
        if self.keep_last == 0:
            if self.save_last:
                trainer.save_checkpoint(self.last_model_path)
            return
        name = self.filename.format(epoch=state.epoch, step=state.global_step) + _SUFFIX
        kept = [other for other in self._kept if other != name] + [name]
        cut = 0 if self.keep_last is None else max(len(kept) - self.keep_last, 0)
        dropped, self._kept = kept[:cut], kept[cut:]  # the new file stores the list it ends
        path = os.path.join(self.dirpath, name)
        trainer.save_checkpoint(path)
        files = _files_of_this_rank(trainer)
        after_pending_saves(trainer, lambda: self._after_periodic(path, dropped, files))

    def _after_periodic(
        self, path: str, dropped: list[str], files: Callable[[str], list[str]]
    ) -> None:
        if self.save_last:
            for source, target in zip(files(path), files(self.last_model_path)):
                _replace_with_copy_of(source, target)
        for name in dropped:
            for file in files(os.path.join(self.dirpath, name)):
                with contextlib.suppress(FileNotFoundError):  # gone already (an older timeline)
                    os.remove(file)


def _files_of_this_rank(trainer: Any) -> Callable[[str], list[str]]:
    """The files this process writes for a checkpoint path: the path itself when alone; in a
    distributed fit its own rank file, plus the main file on rank zero."""
    ctx = getattr(trainer, "dist", None)
    if ctx is None or not ctx.enabled:
        return lambda path: [path]
    own = [] if ctx.rank else [True]
    return lambda path: [path for _ in own] + [rank_path(path, ctx.rank)]
