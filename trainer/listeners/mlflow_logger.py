"""Training and validation scalars, hyperparameters and artifacts to an MLflow run."""

from __future__ import annotations

import os
import time
from typing import Any

import attrs

from trainer import validators
from trainer.listeners._common import import_optional
from trainer.listeners.tracker import ExperimentTracker

__all__ = ["MLflowLogger"]

_BATCH = 100
"""Values per ``log_batch`` call (MLflow takes at most 100 parameters, 1000 metrics)."""
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
"""Tracking URI schemes of MLflow's SQLAlchemy store."""


def _mlflow_client() -> Any:
    module = import_optional(
        "mlflow.tracking",
        owner="MLflowLogger",
        package="mlflow",
        extra="mlflow",
        install="mlflow-skinny",
    )
    return module.MlflowClient


def _needs_sqlalchemy(uri: str) -> None:
    if uri.split(":", 1)[0].split("+", 1)[0] in _DATABASES:
        for module in ("sqlalchemy", "alembic"):
            import_optional(
                module,
                owner=f"MLflowLogger with the tracking URI {uri}",
                package=module,
                extra="mlflow",
                install=module,
            )


@attrs.define(eq=False)
class MLflowLogger(ExperimentTracker):
    """The scalars of :class:`ExperimentTracker` as the metrics of an MLflow run, with the
    caller's hyperparameters (MLflow's params) and artifacts.

    Where the run goes: ``tracking_uri`` when given (a server ``http://...``, a database
    ``sqlite:///...``, ...); else ``folder``, a local folder holding an SQLite store
    (``mlflow.db``) and the artifacts (``artifacts/``), which ``mlflow ui --backend-store-uri
    sqlite:///FOLDER/mlflow.db`` shows; else MLflow's own choice (``MLFLOW_TRACKING_URI``). The
    run belongs to the experiment ``experiment``, created when missing (its artifacts under
    ``folder``'s when a folder is given). It talks to the store through an ``MlflowClient`` and
    never touches MLflow's global active run.

    A run ends ``FINISHED``, or ``FAILED`` after an exception in the fit. A parameter keeps the
    value it was first logged with (MLflow refuses another).

    Args:
        experiment: The experiment's name.
        run_name: The run's name (default: MLflow makes one).
        tracking_uri: MLflow's tracking URI.
        folder: A local folder for the store and the artifacts (when ``tracking_uri`` is None).
        log_every_n_steps: Batches per training row.
        keep_open: See :class:`ExperimentTracker`.

    Raises:
        MissingPackageError: When mlflow (or, for a database URI, SQLAlchemy) is not installed
            (an ``ImportError``).
        ValueError: When an argument is invalid.

    Example:
        >>> from trainer import Trainer
        >>> trainer = Trainer()
        >>> logger = MLflowLogger(folder="runs/mlflow", experiment="digits")  # doctest: +SKIP
        >>> trainer.subscribe(logger)  # doctest: +SKIP
        'mlflow_logger_0'
    """

    experiment: str = attrs.field(
        default="trainer", validator=validators.non_empty_string("an experiment name")
    )
    run_name: str | None = attrs.field(
        default=None, validator=validators.non_empty_string("a run name", optional=True)
    )
    tracking_uri: str | None = attrs.field(
        default=None, validator=validators.non_empty_string("a tracking URI", optional=True)
    )
    folder: str | None = attrs.field(default=None, converter=attrs.converters.optional(os.fspath))
    log_every_n_steps: int = attrs.field(default=50, validator=validators.int_at_least(1))
    _client_class: Any = attrs.field(init=False, factory=_mlflow_client, repr=False)
    _client: Any = attrs.field(init=False, default=None, repr=False)
    _run_id: str | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        uri = self.store_uri
        if uri is not None:
            _needs_sqlalchemy(uri)

    @property
    def store_uri(self) -> str | None:
        """The tracking URI the runs go to (None: MLflow's own choice)."""
        if self.tracking_uri is not None:
            return self.tracking_uri
        if self.folder is not None:
            return f"sqlite:///{os.path.abspath(self.folder)}/mlflow.db"
        return None

    @property
    def run_id(self) -> str | None:
        """The open run's id (None when no run is open)."""
        return self._run_id

    def _start_run(self) -> None:
        if self.tracking_uri is None and self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
        client = self._client_class(tracking_uri=self.store_uri)
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self._create_experiment(client)
        run = client.create_run(experiment_id, run_name=self.run_name)
        self._client, self._run_id = client, run.info.run_id

    def _create_experiment(self, client: Any) -> str:
        location = None
        if self.tracking_uri is None and self.folder is not None:
            location = f"{os.path.abspath(self.folder)}/artifacts/{self.experiment}"
        try:
            return client.create_experiment(self.experiment, artifact_location=location)
        except Exception:  # created meanwhile by another process: use it
            experiment = client.get_experiment_by_name(self.experiment)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _send_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(name, value, stamp, step) for name, value in values.items()]
        for start in range(0, len(metrics), _BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[start : start + _BATCH])

    def _send_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        given = [Param(name, str(value)) for name, value in params.items()]
        for start in range(0, len(given), _BATCH):
            self._client.log_batch(self._run_id, params=given[start : start + _BATCH])

    def _send_artifact(self, path: str, name: str) -> None:
        if os.path.isdir(path):
            self._client.log_artifacts(self._run_id, path, artifact_path=name)
        else:
            self._client.log_artifact(self._run_id, path)

    def _flush(self) -> None:
        """Nothing to do: every value is sent when logged."""

    def _end_run(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")
        self._client, self._run_id = None, None
