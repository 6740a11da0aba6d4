"""Shared fixtures and hypothesis settings profiles.

Profiles: ``dev`` (default) and ``ci`` (selected when the ``CI`` environment variable is set):
both deterministic and without deadlines, since the CI machines are small and noisy.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Scripts run as subprocesses by the tests; never import them.
collect_ignore = ["scripts"]


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory):
    """An empty MLflow SQLite store (``mlflow.db``), made once: creating a store's tables takes
    seconds, copying the file milliseconds (:func:`tests.helpers.new_mlflow_store`)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("mlflow-template")
    MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db").search_experiments()
    return folder / "mlflow.db"
