"""``ModelUpdater``: one continual-learning update per call, all state carried through state
folders (:mod:`renate_events.state_folder`).

The updater builds the learner from its arguments (:mod:`renate_events.choices` names the
buffers and optimizers), checks the data before training (``_probes``), trains with its listeners
(``_listeners``), records the update (``_records``) and writes the state folder.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from renate_events.choices import BUFFER_STORAGES, BUFFERS, default_buffer
from renate_events.config import ConfigFile
from renate_events.learners import BaseExperienceReplayLearner
from renate_events.methods import DEFAULT_METHOD, LEARNERS
from renate_events.state_folder import (
    StagedStateFolder,
    folder_key,
    stage,
)
from renate_events.state_folder.contents import load_state
from renate_events.updater._arguments import (
    check_buffer,
    check_early_stopping,
    check_folder,
    check_json_object,
    check_learner_kwargs,
    check_listeners,
    check_output_folder,
    check_task_id,
    check_trainer_kwargs,
    check_transforms,
    max_epochs_of,
    metrics_mapping,
    optional_callable,
)
from renate_events.updater._arguments import (
    check_optimizer_config as _optimizer_config,  # the name the optimizer field's line uses
)
from renate_events.updater._building import updater_learner
from renate_events.updater._config_file import config_arguments
from renate_events.updater._lineage import output_token
from renate_events.updater._listeners import (
    VALIDATION_MEMORY,
    BestWeights,
    ValidationMemory,
    update_listeners,
    validation_data,
)
from renate_events.updater._probes import (
    InputProbe,
    check_buffer_room,
    check_metric,
    check_splits_of_update,
    pair_as_dataset,
)
from renate_events.updater._records import (
    UpdateFunctions,
    architecture_of,
    check_compatible,
    dataset_size,
    manifest_now,
    update_record,
    updater_config,
    with_update,
)
from renate_events.updater._resume import (
    check_checkpoint_every,
    checkpoints_written,
    resumed_result,
    update_checkpoints,
)
from renate_events.updater._undo import all_or_nothing
from trainer import FitResult
from trainer import validators as checks

__all__ = ["ModelUpdater"]


@attrs.define(eq=False)
class ModelUpdater:
    """Runs one continual-learning update per call, carrying all state through folders.

    Args:
        model: The model to update; its architecture must match the input state folder's.
        learner: A name from :data:`renate_events.methods.LEARNERS`.
        learner_kwargs: Keyword arguments of the learner (JSON-able: ``memory_size``,
            ``alpha``, ``batch_size``, ``seed``, ...). A later update may change them, except
            ``memory_size`` and ``feature_modules`` (they shape the stored buffer).
        optimizer: ``{"name": "adam" | "adamw" | "sgd", **kwargs}``, or a factory
            ``f(params)`` returning a ``torch.optim.Optimizer``; a fresh optimizer is made for
            every update (Renate's behaviour).
        buffer: A name from :data:`~renate_events.choices.BUFFERS` (used by learners with a
            memory); by default the learner's (:func:`~renate_events.choices.default_buffer`:
            ``"greedy-class-balancing"`` for ``"gdumb"``, which needs it, ``"herding"`` for
            ``"icarl"``, which needs it, else ``"reservoir"``).
        trainer_kwargs: Keyword arguments of :class:`trainer.Trainer` (``device``, ``precision``,
            ...); ``max_epochs`` here is deprecated (it warns, and contradicting ``max_epochs``
            is a ``ValueError``).
        max_epochs: Epochs per update (Renate's name): 10 by default, as the command line's
            ``--epochs`` (Renate's default is 50). None: the trainer's own rule, one epoch, or
            until ``trainer_kwargs['max_steps']``. The manifest's ``trainer`` records it.
        metadata: Anything JSON-able to keep in the manifest (the command line stores how to
            rebuild its model there).
        input_state_folder: A folder written by a previous update, or None for the first one.
        output_state_folder: Where to write the state after each update, or None. It must not
            exist, or be empty, or be a state folder of the input's lineage (else ``overwrite``);
            it may be the input folder only with ``in_place``.
        in_place: Allow ``output_state_folder`` to be ``input_state_folder``.
        overwrite: Replace a state folder at the output even of another lineage (another model).
        lock_timeout: Seconds to wait for another process's lock on a state folder before
            :class:`~renate_events.state_folder.StateFolderBusyError`.
        loss_fn: ``(outputs, targets) -> losses`` (default: the learner's cross-entropy).
        learning_rate_scheduler: ``f(optimizer)`` returning a scheduler, made for every update.
        learning_rate_scheduler_interval: ``"epoch"`` or ``"step"``.
        listeners: Listeners subscribed to the learner's trainer (their checkpoint state, if any,
            is kept in the state folder, so later updates must subscribe the same ones).
        metrics: ``{name: fn(outputs, targets)}``, reported by validation as ``val_<name>``.
        collate_fn: The ``DataLoader`` collate function for datasets that are not tensors.
        transforms: Functions on whole batches under Renate's names
            (:data:`~renate_events.choices.TRANSFORMS`), passed to the learner.
        metric: A validation metric (``"val_loss"``, ``"val_accuracy"``, ``"val_<name>"``): the
            output state holds the model's weights from the validation where it was best, and
            early stopping watches it. None: the weights after the last epoch.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher ``metric`` is better; None
            (default): ``"max"`` for a metric named ``*accuracy``, else ``"min"`` (Renate's
            default is always ``"min"``).
        early_stopping_enabled: Stop an update once ``metric`` has not improved for
            ``early_stopping_patience`` validations.
        early_stopping_patience: See ``early_stopping_enabled``.
        validation_memory: Validate each update on its own validation data and on all earlier
            updates' (Renate's validation memory), kept in the state folder.
        validation_memory_size: At most this many validation samples are kept (reservoir
            sampling); None keeps all of them.
        config_file: The config file the functions came from (see :meth:`from_config`); its
            SHA-256 and text are recorded, and a later update from a different file is refused
            unless ``accept_config_change``.
        accept_config_change: Allow a config file that differs from the state folder's.
        architecture: The model's name for ``model.json`` (default: the model's
            ``architecture`` attribute, or its class name).
        buffer_storage: A name from :data:`~renate_events.choices.BUFFER_STORAGES`.
            ``"mapped"`` keeps the buffer in memory-mapped files (for buffers larger than RAM);
            the state folder then holds the buffer's snapshot files
            ``buffer.g<generation>.<i>.bin`` beside the checkpoint. The choice is recorded, and a
            later update must make the same one.
        buffer_folder: Where a mapped buffer's working files are made while it is in use
            (default: the output state folder's parent, or its nearest existing ancestor, else
            the input's, the first that may be written, else the system's temporary folder;
            the command line's ``--scratch-dir``); they have no name there, so nothing is left
            when the process ends, killed or not. Best on the disk of the state folders.
            Without ``output_state_folder``, the input state is read in place and the working
            files are made only before training, so that a state on read-only or full storage
            can be evaluated.
        checkpoint_every: Write a mid-update checkpoint every this many optimizer steps beside
            the output folder (``.<name>.resume``); running the same update again after it was
            interrupted (killed, at any point) continues from it and ends as the uninterrupted
            update would. A finished update removes it. Needs ``output_state_folder`` and
            ``buffer_storage="memory"``.
        restart: Start from the input state even if an interrupted update left a mid-update
            checkpoint (default: continue it, or refuse one of another update).

    Raises:
        StateFolderError: From :meth:`update`, before training, when the output folder may not
            be written; after training,
            :class:`~renate_events.state_folder.StateFolderConflictError` when it changed.
        UpdateInputError: From :meth:`update`, before training, when the data does not fit.

    Example:
        >>> import torch, tempfile
        >>> from torch.utils.data import TensorDataset
        >>> from renate_events.state_folder import read_manifest
        >>> folder = tempfile.mkdtemp()
        >>> data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        >>> updater = ModelUpdater(torch.nn.Linear(4, 2), learner="er",
        ...     learner_kwargs={"memory_size": 16, "memory_batch_size": 8},
        ...     max_epochs=1, trainer_kwargs={"device": "cpu"},
        ...     output_state_folder=folder)
        >>> updater.update(data, task_id="day-1").steps
        1
        >>> read_manifest(folder)["task_ids"]
        ['day-1']
    """

    model: nn.Module = attrs.field(validator=attrs.validators.instance_of(nn.Module))
    learner: str = attrs.field(default=DEFAULT_METHOD, validator=checks.one_of(*LEARNERS))
    learner_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=check_learner_kwargs)
    optimizer: dict[str, Any] | Callable[..., torch.optim.Optimizer] = attrs.field(
        factory=lambda: {"name": "adam", "lr": 1e-3}, validator=_optimizer_config
    )
    buffer: str = attrs.field(
        default=attrs.Factory(lambda self: default_buffer(self.learner), takes_self=True),
        validator=checks.one_of(*BUFFERS),
    )
    trainer_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=check_trainer_kwargs)
    max_epochs: int | None = attrs.field(
        default=10, kw_only=True, validator=checks.int_at_least(1, optional=True)
    )
    metadata: dict[str, Any] = attrs.field(factory=dict, validator=check_json_object)
    input_state_folder: str | os.PathLike[str] | None = attrs.field(
        default=None, validator=check_folder
    )
    output_state_folder: str | os.PathLike[str] | None = attrs.field(
        default=None, validator=check_folder
    )
    in_place: bool = attrs.field(default=False, validator=checks.boolean)
    overwrite: bool = attrs.field(default=False, kw_only=True, validator=checks.boolean)
    lock_timeout: float = attrs.field(default=60.0, validator=checks.real_in_range(0.0))
    loss_fn: Callable[..., torch.Tensor] | None = attrs.field(
        default=None, kw_only=True, validator=optional_callable("(outputs, targets) -> losses")
    )
    learning_rate_scheduler: Callable[[torch.optim.Optimizer], Any] | None = attrs.field(
        default=None, kw_only=True, validator=optional_callable("(optimizer) -> scheduler")
    )
    learning_rate_scheduler_interval: str = attrs.field(
        default="epoch", kw_only=True, validator=checks.one_of("epoch", "step")
    )
    listeners: Sequence[Any] = attrs.field(
        factory=tuple, kw_only=True, converter=tuple, validator=check_listeners
    )
    metrics: Mapping[str, Callable[..., Any]] = attrs.field(
        factory=dict, kw_only=True, converter=metrics_mapping
    )
    collate_fn: Callable[[list[Any]], Any] | None = attrs.field(
        default=None, kw_only=True, validator=optional_callable("(samples) -> batch")
    )
    transforms: Mapping[str, Callable[..., Any]] = attrs.field(
        factory=dict, kw_only=True, converter=dict, validator=check_transforms
    )
    metric: str | None = attrs.field(
        default=None, kw_only=True, validator=checks.non_empty_string("a name", optional=True)
    )
    mode: str | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(checks.one_of("min", "max"))
    )
    early_stopping_enabled: bool = attrs.field(
        default=False, kw_only=True, validator=checks.boolean
    )
    early_stopping_patience: int = attrs.field(
        default=3, kw_only=True, validator=checks.int_at_least(1)
    )
    validation_memory: bool = attrs.field(default=True, kw_only=True, validator=checks.boolean)
    validation_memory_size: int | None = attrs.field(
        default=None, kw_only=True, validator=checks.int_at_least(1, optional=True)
    )
    config_file: ConfigFile | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs.validators.instance_of(ConfigFile)),
    )
    accept_config_change: bool = attrs.field(default=False, kw_only=True, validator=checks.boolean)
    architecture: str | None = attrs.field(
        default=None, kw_only=True, validator=checks.non_empty_string("a name", optional=True)
    )
    buffer_storage: str = attrs.field(
        default="memory", kw_only=True, validator=checks.one_of(*BUFFER_STORAGES)
    )
    buffer_folder: str | os.PathLike[str] | None = attrs.field(
        default=None, kw_only=True, validator=check_folder
    )
    checkpoint_every: int | None = attrs.field(
        default=None, kw_only=True, validator=checks.int_at_least(1, optional=True)
    )
    restart: bool = attrs.field(default=False, kw_only=True, validator=checks.boolean)

    _learner: BaseExperienceReplayLearner | None = attrs.field(init=False, default=None)
    _manifest: dict[str, Any] | None = attrs.field(init=False, default=None)
    _seen: dict[str, str | None] = attrs.field(init=False, factory=dict)
    _memory: ValidationMemory | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.max_epochs, self.trainer_kwargs = max_epochs_of(self)  # the deprecated way too
        if self.mode is None:  # an accuracy is better when higher; anything else (a loss) lower
            accuracy = self.metric is not None and self.metric.endswith("accuracy")
            self.mode = "max" if accuracy else "min"
        check_early_stopping(self.early_stopping_enabled, self.metric)
        check_buffer(self.learner, self.buffer, self.buffer_storage)
        check_checkpoint_every(self.checkpoint_every, self.output_state_folder, self.buffer_storage)

    @classmethod
    def from_config(
        cls, config: ConfigFile | str | os.PathLike[str], **kwargs: Any
    ) -> ModelUpdater:
        """An updater whose model and functions come from a config file (see
        :mod:`renate_events.config`); ``kwargs`` are the other arguments of the class.

        ``model_fn`` makes the model (unless ``model`` is given), and ``loss_fn``,
        ``optimizer_fn``, ``lr_scheduler_fn``, ``listeners``, ``metrics_fn``, ``collate_fn`` and
        the transform functions, where the file defines them, give the arguments of the same
        meaning. The file's SHA-256 and text are recorded in the state folder.
        """
        return cls(**config_arguments(config, kwargs))

    @property
    def trainer_arguments(self) -> dict[str, Any]:
        """The update's :class:`trainer.Trainer` arguments: ``trainer_kwargs``, ``max_epochs``."""
        return {**self.trainer_kwargs, "max_epochs": self.max_epochs}

    @property
    def learner_instance(self) -> BaseExperienceReplayLearner:
        """The learner, built (and loaded from ``input_state_folder``) on first use."""
        if self._learner is None:
            self._learner = self._build()
        return self._learner

    @all_or_nothing("_manifest", "_seen")  # a failed update leaves no trace
    def update(
        self,
        train_dataset: torch.utils.data.Dataset[Any],
        val_dataset: torch.utils.data.Dataset[Any] | None = None,
        task_id: str | int | None = None,
        *,
        write: bool = True,
    ) -> FitResult:
        """Train on one new chunk of data and, if configured, write the output state folder.

        Before training, every split and transform is checked against the model and earlier
        updates' samples, the metric against what the update reports, the output folder against
        what may be written. With ``metric``, the model ends with its best validation's weights.
        ``write=False`` leaves the output folder to :meth:`write_output` (a search writes only
        its best trial's). An update that fails or is interrupted, at any point until its folder
        is written, leaves the learner, model, buffer, optimizer and this updater as they were.
        """
        check_task_id(task_id)
        train_dataset = pair_as_dataset(train_dataset, "train_dataset")
        val_dataset = pair_as_dataset(val_dataset, "val_dataset")
        learner = self.learner_instance
        self._expected_output(probe=True)  # checks the output folder, remembers what it holds
        probe = InputProbe(self.collate_fn, self.transforms, self.metrics, self.config_file)
        signature = probe.check(learner, train_dataset, "the training data", lambda: self.history)
        check_buffer_room(learner, signature)
        check_splits_of_update(learner, train_dataset, val_dataset)
        current, validation = validation_data(self._memory, val_dataset, self.collate_fn)
        check_metric(self.metric, self.metrics, validation is not None)
        best = None if self.metric is None else BestWeights(learner.model, self.metric, self.mode)
        checkpoints = update_checkpoints(self, task_id, train_dataset, val_dataset)
        resume_from = None if checkpoints is None else checkpoints.start()
        started = time.time()
        patience = self.early_stopping_patience if self.early_stopping_enabled else None
        with (
            update_listeners(learner.trainer, best, self.metric, self.mode, patience),
            checkpoints_written(learner.trainer, checkpoints, self.checkpoint_every),
        ):
            result = learner.fit(train_dataset, validation, resume_from=resume_from)
        if resume_from is not None:
            result = resumed_result(result, learner.trainer.state)
        if best is not None and best.weights is not None:
            learner.model.load_state_dict(best.weights)
        if current is not None and self._memory is not None:
            self._memory.buffer.update(*current)
        record = update_record(
            task_id,
            result,
            time.time() - started,
            signature=signature,
            samples=dataset_size(train_dataset),
            best=best,
            functions=UpdateFunctions.of(self),
            learner_kwargs=self.learner_kwargs,
            config_sha256=None if self.config_file is None else self.config_file.sha256,
        )
        self._manifest = with_update(self._manifest_now(), task_id, record)
        if write and self.output_state_folder is not None:
            self.write_output()
        if checkpoints is not None:
            checkpoints.finish()
        return result

    def write_output(self, files: Mapping[str, bytes] | None = None) -> None:
        """Write the state to ``output_state_folder`` if it still holds what it held when the
        last update started (else :class:`~renate_events.state_folder.StateFolderConflictError`);
        ``files`` adds optional files (``search.csv``)."""
        if self.output_state_folder is None:
            raise ValueError("ModelUpdater.write_output: no output_state_folder is set")
        expected = self._expected_output()
        staged = stage(
            folder_key(self.output_state_folder),
            self.learner_instance,
            self._manifest_now(),
            expected,
            self.lock_timeout,
            files,
        )
        staged.commit()
        self._seen[staged.folder] = staged.token

    def stage_state(
        self, folder: str | os.PathLike[str], *, expected: str | None
    ) -> StagedStateFolder:
        """Write the current state beside ``folder``, ready to be swapped in.

        Holds ``folder``'s exclusive lock until the staged folder's ``commit`` or ``abort``
        (:class:`~renate_events.state_folder.StagedStateFolder`): several folders can be staged
        first and committed together once all of them were written.

        Args:
            folder: The state folder to replace (or create).
            expected: What ``folder`` must still hold: the answer of
                :func:`~renate_events.state_folder.state_token` from before the update started
                (None: nothing, or an empty folder).

        Raises:
            StateFolderConflictError: ``folder`` holds something else now.
            StateFolderError: ``folder`` may not be replaced (see
                :func:`~renate_events.state_folder.state_token`).
            StateFolderBusyError: Another process held the lock for ``lock_timeout`` seconds.
            trainer.CheckpointError: The folder could not be written (disk full, file-size
                limit, permissions); nothing was changed and nothing is left behind.
        """
        manifest = self._manifest_now()
        return stage(
            folder_key(folder), self.learner_instance, manifest, expected, self.lock_timeout
        )

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per update so far (of this updater and the folders it continued)."""
        return list(self._manifest_now()["history"])

    # -- building and loading ------------------------------------------------------------------

    def _build(self) -> BaseExperienceReplayLearner:
        learner = updater_learner(self)
        if self.input_state_folder is not None:
            folder = folder_key(self.input_state_folder)

            def prepare(manifest: dict[str, Any]) -> None:  # before the checkpoint is loaded
                # Runs again when a writer disturbed the read and it is retried under the lock:
                # each run starts the validation memory afresh instead of subscribing a second.
                check_compatible(self, manifest)
                self._keep_memory(learner, False)
                self._keep_memory(learner, manifest["validation_memory"])

            try:
                self._manifest, self._seen[folder] = load_state(
                    folder, learner, self.lock_timeout, prepare
                )
            except BaseException:
                self._keep_memory(learner, False)
                raise
        self._keep_memory(learner, self.validation_memory)  # dropped: the next state has none
        return learner

    def _keep_memory(self, learner: BaseExperienceReplayLearner, wanted: bool) -> None:
        """Subscribe a validation memory to ``learner`` if ``wanted`` and none is, unsubscribe
        it if not ``wanted``; ``_memory`` is the subscribed one, or None."""
        if wanted and self._memory is None:
            seed = self.learner_kwargs.get("seed", 0)
            memory = ValidationMemory.of_size(self.validation_memory_size, seed)
            learner.trainer.subscribe(memory, name=VALIDATION_MEMORY)
            self._memory = memory
        elif not wanted and self._memory is not None:
            learner.trainer.unsubscribe(self._memory)
            self._memory = None

    # -- the state folders ---------------------------------------------------------------------

    def _expected_output(self, probe: bool = False) -> str | None:
        """Check the output folder (``probe``: that it can be written); remember what it holds."""
        if self.output_state_folder is None:
            return None
        output = folder_key(self.output_state_folder)
        check_output_folder(output, self.input_state_folder, self.in_place, probe)
        if output not in self._seen:
            self._seen[output] = output_token(
                output, self._manifest, self.overwrite, self.lock_timeout
            )
        return self._seen[output]

    def _manifest_now(self) -> dict[str, Any]:
        return manifest_now(
            self._manifest,
            updater_config(self),
            trainer=self.trainer_arguments,
            metadata=self.metadata,
            architecture=self.architecture or architecture_of(self.model),
            validation_memory=self._memory is not None,
            config_file=self.config_file,
            buffer_storage=self.buffer_storage,
        )
