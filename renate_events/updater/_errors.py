"""The error of an update's input: data, a config file or a metric that does not fit."""

from __future__ import annotations

__all__ = ["UpdateInputError"]


class UpdateInputError(ValueError):
    """Raised before training when the data does not fit the model or the state folder (sample
    shapes or dtypes, labels, a model that refuses the inputs), when a config file differs from
    the one the state folder was written with, or when the best-model metric is not reported."""
