"""Training and validation scalars, hyperparameters and artifacts to a Weights & Biases run."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import attrs

from trainer import validators
from trainer.listeners._common import import_optional
from trainer.listeners.tracker import ExperimentTracker

__all__ = ["WandbLogger"]

_QUIET = {"silent": True, "console": "off"}
"""W&B settings this logger starts from: no output of its own and no capture of the process's
standard output (``settings`` may change them)."""


def _wandb() -> Any:
    return import_optional(
        "wandb", owner="WandbLogger", package="wandb", extra="wandb", install="wandb"
    )


def _artifact_name(name: str) -> str:
    """``name`` with what W&B refuses in an artifact's name (anything but letters, digits,
    ``-``, ``_`` and ``.``) replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name) or "artifact"


@attrs.define(eq=False)
class WandbLogger(ExperimentTracker):
    """The scalars of :class:`ExperimentTracker` as the history of a Weights & Biases run, with
    the caller's hyperparameters (the run's config) and artifacts.

    Each run is made with ``wandb.init(..., reinit="create_new")``: a run the caller has open
    stays open and untouched. ``mode`` is W&B's: ``"online"``, ``"offline"`` (the run is written
    under ``dir`` only, for a later ``wandb sync``), ``"disabled"``; None leaves it to W&B
    (``WANDB_MODE``, then its settings). W&B's own output and its capture of the console are off
    unless ``settings`` turns them on. W&B needs increasing steps: a fit resumed from a
    checkpoint into a run that logged later steps has those rows dropped by W&B (with a
    warning). A run ends with exit code 0, or 1 after an exception in the fit.

    Args:
        project: The project's name (default: W&B's, ``WANDB_PROJECT``).
        name: The run's name (default: W&B makes one).
        dir: The folder under which W&B writes its ``wandb/`` folder (default: W&B's,
            ``WANDB_DIR``, else the working folder).
        mode: ``"online"``, ``"offline"``, ``"disabled"`` or None.
        settings: More ``wandb.Settings`` fields (``{"x_disable_stats": True}``).
        log_every_n_steps: Batches per training row.
        keep_open: See :class:`ExperimentTracker`.

    Raises:
        MissingPackageError: When wandb is not installed (an ``ImportError``).
        ValueError: When an argument is invalid.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> logger = WandbLogger(project="digits", mode="offline")  # doctest: +SKIP
        >>> trainer.subscribe(logger)  # doctest: +SKIP
        'wandb_logger_0'
    """

    project: str | None = attrs.field(
        default=None, validator=validators.non_empty_string("a project name", optional=True)
    )
    name: str | None = attrs.field(
        default=None, validator=validators.non_empty_string("a run name", optional=True)
    )
    dir: str | None = attrs.field(default=None, converter=attrs.converters.optional(os.fspath))
    mode: str | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(validators.one_of("online", "offline", "disabled")),
    )
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    log_every_n_steps: int = attrs.field(default=50, validator=validators.int_at_least(1))
    _wandb: Any = attrs.field(init=False, factory=_wandb, repr=False)
    _run: Any = attrs.field(init=False, default=None, repr=False)

    @property
    def run(self) -> Any:
        """The open ``wandb`` run (None when no run is open)."""
        return self._run

    def _start_run(self) -> None:
        given = {"project": self.project, "name": self.name, "dir": self.dir, "mode": self.mode}
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self._run = self._wandb.init(
            **{key: value for key, value in given.items() if value is not None},
            reinit="create_new",
            settings=self._wandb.Settings(**{**_QUIET, **self.settings}),
        )

    def _send_metrics(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def _send_params(self, params: dict[str, Any]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def _send_artifact(self, path: str, name: str) -> None:
        folder = os.path.isdir(path)
        artifact = self._wandb.Artifact(_artifact_name(name), type="folder" if folder else "file")
        if folder:
            artifact.add_dir(path)
        else:
            artifact.add_file(path)
        self._run.log_artifact(artifact)

    def _flush(self) -> None:
        """Nothing to do: W&B sends what is logged in the background."""

    def _end_run(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
        self._run = None
