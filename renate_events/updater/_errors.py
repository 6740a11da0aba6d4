"""The errors of an update: its input (data, a config file or a metric that does not fit) and a
mid-update checkpoint it may not continue from."""

from __future__ import annotations

from renate_events.state_folder import StateFolderError

__all__ = ["MidUpdateCheckpointError", "UpdateInputError"]


class UpdateInputError(ValueError):
    """Raised before training when the data does not fit the model or the state folder (sample
    shapes or dtypes, labels, a model that refuses the inputs), when a config file differs from
    the one the state folder was written with, or when the best-model metric is not reported."""


class MidUpdateCheckpointError(StateFolderError):
    """Raised before training when the mid-update checkpoint beside the output state folder
    (``.<name>.resume``) belongs to another update, is malformed or was changed after it was
    written; the message names the file and how to proceed (run the same update again, or
    ``restart=True``). Nothing is changed."""
