"""State folders: everything a continual update needs to continue where the previous one stopped.

A *state folder* holds:

``manifest.json``
    ``{"format": "renate_events.state", "format_version": 2, "learner": "der", "learner_kwargs":
    {...}, "optimizer": {...}, "buffer": "reservoir", "trainer": {...}, "model": {"<parameter>":
    [shape, dtype], ...}, "architecture": "...", "updates": 3, "task_ids": [...], "history":
    [{...}, ...], "config": {...} | null, "validation_memory": true, "metadata": {...}, "files":
    {"learner.safetensors": "<sha256>", ...}}``. ``history`` has one record per update: its task
    id, steps, logged metrics, hyperparameters, the names of the functions it used, the sample
    shapes of its data and the best-model selection. ``config`` is the config file's name, SHA-256
    and text (kept to say what changed when a later update uses another).
``learner.safetensors``
    the learner's trainer checkpoint (model, optimizer, buffer, components, validation memory,
    RNG; see :mod:`trainer.checkpoint`).
``model.safetensors``
    the model alone, loadable with ``safetensors.torch.load_file`` and ``load_state_dict``
    without this library (the deployable artifact).
``model.json``
    a short card: the architecture's name, the config file's SHA-256, the parameters' shapes and
    the update history (task id, steps, metrics of each update).

Folders of format version 1 (``manifest.json`` and ``learner.safetensors`` only) are read as
well; the next update writes them as version 2.

Writing and reading (the rules of ``docs/guarantees.rst``, "State folders"):

- A writer holds the exclusive lock ``.<name>.lock`` beside the folder
  (:class:`trainer.files.FileLock`) while it stages the new folder beside the old one
  (``.<name>.staging.<hex>``) and swaps it in; readers hold the shared lock while they read, so
  they never see a swap half done.
- A crash between the swap's two renames leaves the old folder under ``.<name>.old.<hex>``; it is
  moved back under the exclusive lock, which a live writer would hold, so a reader never repairs
  a swap in progress.
- Only a state folder or an empty folder is ever replaced; a file, a link or any other folder at
  the output path is refused.
- An update writes its output only if the output still holds what the update saw before it
  trained (for an in-place update: the state it read). Otherwise writing would discard an update
  it never saw, and it is refused with :class:`StateFolderConflictError`.
- A manifest is checked against a strict schema (:func:`read_manifest`) and every file against its
  checksum before anything of it is used. Nothing is pickled.

The modules: :mod:`~renate_events.state_folder.manifest` (the format and its schema),
``locks`` (locks, reading under them, tokens), ``contents`` (the files besides the manifest,
written and loaded), ``swap`` (stage and swap), ``recovery`` (interrupted swaps and leftovers)
and ``errors``. :class:`~renate_events.updater.ModelUpdater` writes and reads state folders
through them; nothing here knows the updater.

Example:
    >>> import tempfile
    >>> from renate_events.state_folder import state_token
    >>> state_token(tempfile.mkdtemp()) is None  # an empty folder may become a state folder
    True
"""

from renate_events.state_folder.errors import (
    StateFolderBusyError,
    StateFolderConflictError,
    StateFolderError,
    StateFolderOverwriteError,
)
from renate_events.state_folder.locks import folder_key, read_manifest, state_token
from renate_events.state_folder.manifest import FORMAT_NAME, FORMAT_VERSION
from renate_events.state_folder.swap import (
    StagedStateFolder,
    check_writable,
    stage,
    write_state_folder,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "StagedStateFolder",
    "StateFolderBusyError",
    "StateFolderConflictError",
    "StateFolderError",
    "StateFolderOverwriteError",
    "check_writable",
    "folder_key",
    "read_manifest",
    "stage",
    "state_token",
    "write_state_folder",
]
