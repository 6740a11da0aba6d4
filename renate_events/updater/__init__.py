"""Production-style continual updates: one model update per new chunk of data, state in folders.

:class:`ModelUpdater` runs the updates; what a state folder holds, and how it is written and read
safely, is :mod:`renate_events.state_folder`'s (re-exported here: ``read_manifest``,
``state_token``, ``StagedStateFolder`` and the errors). The names an update chooses from
(``BUFFERS``, ``BUFFER_STORAGES``, ``OPTIMIZERS``, ``TRANSFORMS``, ``default_buffer``) are
:mod:`renate_events.choices`'.

The modules of this package: ``_updater`` (the class), ``_arguments`` (checks of its arguments),
``_probes`` (the data checked against the model before training), ``_listeners`` (best weights
and the validation memory), ``_records`` (what the manifest records of an update),
``_config_file`` (the config file's arguments, record and check), ``_resume`` (mid-update
checkpoints: an interrupted update continues) and ``_errors``.
"""

from renate_events.choices import BUFFER_STORAGES, BUFFERS, OPTIMIZERS, TRANSFORMS, default_buffer
from renate_events.state_folder import (
    StagedStateFolder,
    StateFolderBusyError,
    StateFolderConflictError,
    StateFolderError,
    StateFolderOverwriteError,
    read_manifest,
    state_token,
)
from renate_events.updater._config_file import check_config_file
from renate_events.updater._errors import MidUpdateCheckpointError, UpdateInputError
from renate_events.updater._probes import dataset_tensors
from renate_events.updater._records import check_kept_settings
from renate_events.updater._updater import ModelUpdater

__all__ = [
    "BUFFERS",
    "BUFFER_STORAGES",
    "OPTIMIZERS",
    "TRANSFORMS",
    "MidUpdateCheckpointError",
    "ModelUpdater",
    "StagedStateFolder",
    "StateFolderBusyError",
    "StateFolderConflictError",
    "StateFolderError",
    "StateFolderOverwriteError",
    "UpdateInputError",
    "check_config_file",
    "check_kept_settings",
    "dataset_tensors",
    "default_buffer",
    "read_manifest",
    "state_token",
]
