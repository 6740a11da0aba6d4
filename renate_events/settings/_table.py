"""Every setting of the command line (:data:`SETTINGS`) and the settings each command takes
(:data:`COMMANDS`)."""

from __future__ import annotations

import attrs

from renate_events.choices import BUFFER_STORAGES, BUFFERS, OPTIMIZERS, TRACKERS
from renate_events.methods import CLASSIFIERS, DEFAULT_METHOD, LEARNERS, METHODS, MethodSpec, method
from renate_events.models import MODELS
from renate_events.scenarios import IMAGE_SCENARIOS, SCENARIOS
from renate_events.settings._record import Setting, device, list_of_ints, model_args
from trainer.capture import CAPTURE_MODES

__all__ = ["COMMANDS", "MAX_SEED", "PRECISIONS", "SETTINGS", "commands_of", "setting"]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
"""The precisions :class:`trainer.Trainer` takes (a test checks that it takes exactly these)."""

MAX_SEED = 2**63
"""Seeds are ints in ``[0, MAX_SEED)`` (what ``torch.manual_seed`` takes)."""


# -- help texts made from the method registry ----------------------------------------------------


def _learner_shown() -> str:
    name = DEFAULT_METHOD
    return f"{name}, i.e. {method(name).summary.split(' (')[0]}"


def _buffer_shown() -> str:
    usual = attrs.fields(MethodSpec).default_buffer.default
    others = [
        f"{spec.default_buffer} for {name}"
        for name, spec in METHODS.items()
        if spec.default_buffer != usual
    ]
    return "; ".join([usual, ", ".join(others)] if others else [usual])


def _classifier_help() -> str:
    names = [name for name, spec in METHODS.items() if spec.classifier == "nme"]
    return (
        f"default: the method's own (nme for {' and '.join(names)}, logits for the others); "
        "logits: the model's argmax; nme: the nearest mean of exemplars (a state folder of "
        f"--learner {' or '.join(names)})"
    )


def _scenario_help() -> str:
    digits, images = list(SCENARIOS), list(IMAGE_SCENARIOS)
    return (
        f"{digits[0]} (default), {', '.join(digits[1:])}; {', '.join(images)} (read from "
        "--data-dir)"
    )


# -- the settings ---------------------------------------------------------------------------------

_UPDATER = "renate_events.updater:ModelUpdater."
_LEARNER = "renate_events.learners:BaseExperienceReplayLearner."
_TRAINER = "trainer:Trainer."
_MMD = "renate_events.shift:MMDCovariateShiftDetector."
_CLASSES = "renate_events.scenarios:ClassIncrementalScenario."
_SCENARIO_NAMES = tuple(sorted({**SCENARIOS, **IMAGE_SCENARIOS}))
_CONFIG_FILE_HELP = (
    "Python file defining model_fn, data_fn and optionally loss_fn, optimizer_fn, ... "
    "(see the docs' 'Bring your own model and data')"
)

_ALL = (
    # where the options come from
    Setting("config", "TOML file with any of these options (flags override it)"),
    Setting(
        "config_file",
        _CONFIG_FILE_HELP,
        maps_onto=(_UPDATER + "config_file",),
        variants={
            "evaluate": {"help": "evaluate on test_data_fn's chunks (see --chunk-ids)"},
            "shift": {"help": "the config file the --state was written with"},
            "predict": {
                "help": "the config file the --state was written with: its model_fn builds the "
                "model; predict on a chunk (--chunk-id) or on a file's inputs (--data)"
            },
        },
    ),
    # run: the scenario and the model
    Setting(
        "scenario",
        _scenario_help,
        default="split-digits",
        choices=_SCENARIO_NAMES,
        parser_choices=False,
        variants={
            "evaluate": {
                "default": None,
                "help": "evaluate on every task's test set of this scenario",
            }
        },
    ),
    Setting(
        "data_dir",
        "with an image scenario: the folder of its data set (CIFAR binary version, "
        "tiny-imagenet-200; never downloaded)",
        variants={
            "evaluate": {
                "help": "with an image scenario: the folder of its data set (CIFAR binary version, "
                "tiny-imagenet-200)"
            }
        },
    ),
    Setting(
        "class_order",
        "class-incremental scenarios: the order of the classes, seed:N (shuffled with seed N) or "
        "the class ids in order, comma-separated such as 3,1,0,2 (default: sorted); recorded in "
        "the results and the state folders",
        metavar="ORDER",
        maps_onto=(_CLASSES + "class_order",),
        variants={
            "evaluate": {
                "help": "with --scenario: the class order of the tasks, as run's --class-order "
                "(default: the one the state folder's run recorded; sorted for a folder without a "
                "record); a state folder's recorded order may only be repeated (by any order "
                "making the same tasks)"
            }
        },
    ),
    Setting(
        "blurry",
        "class-incremental scenarios: the share of each task's training samples that moves to "
        "other tasks (blurry boundaries, Blurry-M), in [0, 1] (default {default})",
        kind="float",
        default=0.0,
        low=0.0,
        high=1.0,
        metavar="M",
        maps_onto=(_CLASSES + "blurry",),
    ),
    Setting(
        "online",
        "online continual learning: one pass over each task's data (each sample seen once, in "
        "batches of --batch-size), the accuracy on the tasks seen so far every --eval-every "
        "steps (the anytime-accuracy curve in results.json and anytime_accuracy.png)",
        kind="flag",
    ),
    Setting(
        "eval_every",
        "with --online: training steps between two evaluations (default {default})",
        kind="int",
        default=50,
        low=1,
        deferred=True,
        metavar="STEPS",
        maps_onto=("renate_events.anytime:AnytimeAccuracy.every",),
    ),
    Setting(
        "no_augment",
        "image scenarios: no random crop and flip in training (still to float, normalised)",
        kind="flag",
    ),
    Setting(
        "chunks",
        "with --config-file: the number of updates (data_fn's chunks 0..N-1; at least 2, "
        "since forgetting and transfer compare updates)",
        kind="int",
        low=2,
        high=10**6,
    ),
    Setting(
        "seeds",
        "one or several seeds",
        kind="ints",
        default=[0],
        check=list_of_ints(0, MAX_SEED, empty=False, distinct=True),
    ),
    Setting(
        "hidden",
        "hidden layer sizes of --model mlp (default {default})",
        kind="ints",
        default=[256],
        deferred=True,
        check=list_of_ints(1, None, empty=True, distinct=False),
    ),
    Setting(
        "model",
        "model of renate_events.models (default: mlp for the digits scenarios, resnet18 with nf "
        "20 for the image ones)",
        choices=tuple(sorted(MODELS)),
        variants={"update": {"help": "model (a check: the input state's model must be this one)"}},
    ),
    Setting(
        "pretrained",
        "with --model vit on an image scenario: a Hugging Face ViT to start from, its "
        "save_pretrained folder or model.safetensors file (never downloaded; its architecture "
        "replaces --model-args)",
        metavar="PATH",
    ),
    Setting(
        "model_args",
        "the model's arguments as a TOML or JSON table: '{nf = 20}', '{\"dim\": 64}' "
        "(num_classes, inputs, in_channels and image_size come from the scenario)",
        kind="table",
        metavar="TABLE",
        check=model_args,
        variants={
            "update": {"help": "its arguments (a check: the input state's model must be this one)"}
        },
    ),
    Setting("output_dir", "where results are written", default="runs/latest"),
    # the experiment tracker of run and update
    Setting(
        "tracker",
        "log the hyperparameters, the training and validation metrics, the accuracy after each "
        "update and the results or the output state to an experiment tracker (default: none)",
        choices=tuple(TRACKERS),
    ),
    Setting(
        "tracker_dir",
        "the tracker's folder: MLflow's SQLite store and artifacts, W&B's wandb/ folder, "
        "TensorBoard's event files (default: tracking/ beside the output)",
    ),
    Setting(
        "tracking_uri",
        "with --tracker mlflow: MLflow's tracking URI (a server, a database) instead of a store "
        "in --tracker-dir",
    ),
    Setting(
        "tracker_project",
        "MLflow's experiment, W&B's project (default {default})",
        default="renate-events",
    ),
    Setting(
        "tracker_run_name",
        "the tracker's run (default: the output folder's name; run adds -seed<k>)",
    ),
    # update: the state folders
    Setting("input_state", "a state folder written by run/update"),
    Setting(
        "data",
        ".safetensors or .npz file with 'inputs' and 'targets'",
        variants={
            "update": {
                "help": ".safetensors or .npz file with 'inputs' and 'targets' (no --config-file)"
            },
            "predict": {
                "help": ".safetensors or .npz file with 'inputs' ('targets' not needed); with "
                "--config-file, kept as stored for its test_transform"
            },
        },
    ),
    Setting(
        "output_state",
        "the state folder to write: new, empty, or a state folder (never anything else)",
        required=True,
    ),
    Setting(
        "chunk_id",
        "with --config-file: the chunk data_fn gives (default: the input state's number of "
        "updates, so 0 for a first update)",
        kind="int",
        low=0,
        variants={
            "predict": {
                "help": "with --config-file: the chunk to predict on (test_data_fn's data, else "
                "data_fn's validation data)"
            }
        },
    ),
    Setting(
        "seed",
        "seeds model_fn's initial weights and is given to data_fn (default {default})",
        kind="int",
        default=0,
        low=0,
        high=MAX_SEED,
        maps_onto=(_LEARNER + "seed", _MMD + "seed"),
        variants={
            "evaluate": {
                "default": None,
                "help": "with --scenario: the seed of its split (default: the one the state "
                "folder's run recorded, which it may only repeat; else 0); with --config-file: "
                "given to data_fn (default 0)",
            },
            "predict": {"help": "the seed given to data_fn / test_data_fn"},
            "shift": {"help": "seed of the permutations"},
        },
    ),
    Setting(
        "in_place",
        "allow --output-state to be --input-state",
        kind="flag",
        maps_onto=(_UPDATER + "in_place",),
    ),
    Setting(
        "overwrite",
        "allow --output-state to replace a state folder of another lineage (another model's: not "
        "the input state, nor a part or a continuation of its history)",
        kind="flag",
        maps_onto=(_UPDATER + "overwrite",),
        variants={
            "run": {
                "help": "allow --output-dir to replace the results and the state folders of an "
                "earlier run"
            }
        },
    ),
    Setting(
        "accept_config_change",
        "continue a state folder written with another version of the config file",
        kind="flag",
        maps_onto=(_UPDATER + "accept_config_change",),
        variants={
            "evaluate": {
                "help": "evaluate a state folder written with another version of the config file"
            },
            "shift": {"help": "use a --state written with another version of the config file"},
            "predict": {
                "help": "predict with a state folder written with another version of the config "
                "file"
            },
        },
    ),
    Setting(
        "checkpoint_every",
        "write a mid-update checkpoint every N optimizer steps beside --output-state (the hidden "
        "folder .<name>.resume): the same update command run again after an interruption "
        "continues from it; a finished update removes it",
        kind="int",
        low=1,
        maps_onto=(_UPDATER + "checkpoint_every",),
    ),
    Setting(
        "restart",
        "start from --input-state even if an interrupted update left a mid-update checkpoint "
        "(which is then discarded; default: continue it)",
        kind="flag",
        maps_onto=(_UPDATER + "restart",),
    ),
    Setting("task_id", "a name for this update"),
    Setting(
        "search",
        "with --config-file: run TRIALS trials of this update (Optuna) over the search space of "
        "the --config TOML file and keep the best (see the docs' search section)",
        kind="int",
        low=1,
        high=10**5,
        metavar="TRIALS",
    ),
    Setting(
        "search_storage",
        "Optuna storage URL (sqlite:///search.db, postgresql://...): resume an interrupted "
        "search, or share one among workers",
    ),
    Setting("search_study", "the study's name in --search-storage"),
    Setting(
        "search_pruner",
        "{default} (default): stop trials worse than the median at the same epoch; none",
        default="median",
        choices=("median", "none"),
    ),
    Setting(
        "buffer_storage",
        "memory: the buffer in RAM, saved in the checkpoint; mapped: memory-mapped files, saved "
        "as files of the state folder, for buffers larger than RAM",
        default="memory",
        deferred=True,
        later=True,
        choices=BUFFER_STORAGES,
        maps_onto=(_UPDATER + "buffer_storage",),
    ),
    Setting(
        "scratch_dir",
        "with mapped storage: the folder of the buffer's working files, which have no name and "
        "go when the process ends (default: the output state's parent, else the input's, "
        "else the system's temporary folder; one that may be written)",
        maps_onto=(_UPDATER + "buffer_folder",),
    ),
    Setting(
        "lock_timeout",
        "seconds to wait for another update of the same folder (default {default})",
        kind="float",
        default=60.0,
        low=0.0,
        maps_onto=(_UPDATER + "lock_timeout",),
    ),
    # the learner, the optimizer and the trainer
    Setting(
        "learner",
        "continual-learning method",
        default=DEFAULT_METHOD,
        choices=tuple(sorted(LEARNERS)),
        later=True,
        shown=_learner_shown,
        maps_onto=(_UPDATER + "learner",),
    ),
    Setting(
        "buffer",
        "memory buffer type",
        choices=tuple(BUFFERS),
        later=True,
        shown=_buffer_shown,
        maps_onto=(_UPDATER + "buffer", _LEARNER + "buffer"),
    ),
    Setting(
        "memory_size",
        "buffer slots",
        kind="int",
        default=200,
        low=0,
        deferred=True,
        later=True,
        maps_onto=(_LEARNER + "memory_size",),
    ),
    Setting(
        "epochs",
        "epochs per update",
        kind="int",
        default=10,
        low=1,
        later=True,
        maps_onto=(_UPDATER + "max_epochs",),
    ),
    Setting(
        "lr",
        "learning rate",
        kind="float",
        default=1e-3,
        low=0.0,
        low_open=True,
        deferred=True,
        later=True,
        shown="1e-3",
        maps_onto=(_UPDATER + "optimizer[lr]", _LEARNER + "optimizer[lr]"),
    ),
    Setting(
        "optimizer",
        "optimizer",
        default="adam",
        choices=tuple(OPTIMIZERS),
        deferred=True,
        later=True,
        maps_onto=(_UPDATER + "optimizer[name]", _LEARNER + "optimizer[name]"),
    ),
    Setting(
        "momentum", "SGD momentum", kind="float", low=0.0, deferred=True, later=True, shown="0"
    ),
    Setting(
        "weight_decay",
        "weight decay",
        kind="float",
        low=0.0,
        deferred=True,
        later=True,
        shown="torch's",
    ),
    Setting(
        "batch_size",
        "new-data batch",
        kind="int",
        default=32,
        low=1,
        later=True,
        maps_onto=(_LEARNER + "batch_size",),
    ),
    Setting(
        "memory_batch_size",
        "memory batch",
        kind="int",
        default=32,
        low=1,
        later=True,
        maps_onto=(_LEARNER + "memory_batch_size",),
    ),
    Setting(
        "device",
        "auto (CUDA if available), cpu, cuda:0",
        default="auto",
        check=device,
        later=True,
        shown="",
        maps_onto=(_TRAINER + "device",),
    ),
    Setting(
        "precision",
        "floating-point precision of training",
        default="32",
        choices=PRECISIONS,
        later=True,
        maps_onto=(_TRAINER + "precision",),
    ),
    Setting(
        "tf32",
        "--tf32: TensorFloat-32 in CUDA matmuls and convolutions while training (faster on "
        "Ampere GPUs and later, 10-bit mantissa); --no-tf32: never; no effect on the CPU",
        kind="switch",
        later=True,
        shown="torch's: convolutions only",
        maps_onto=(_TRAINER + "tf32",),
    ),
    Setting(
        "channels_last",
        "train in the channels-last memory format (the model and the image batches): faster "
        "convolutions on a GPU, the same values",
        kind="switch",
        default=False,
        later=True,
        shown="no",
        maps_onto=(_TRAINER + "channels_last",),
    ),
    Setting(
        "nonfinite_loss",
        "what a NaN or infinite training loss does: raise (stop the update, nothing written) or "
        "skip (no optimizer step for that batch; a metrics logger counts them as skipped_batches)",
        default="raise",
        choices=("raise", "skip"),
        later=True,
        maps_onto=(_TRAINER + "nonfinite_loss",),
    ),
    Setting(
        "capture",
        "how training steps run: off (eager), compile (torch.compile: forward, losses and their "
        "backward compiled; any device) or graph (compiled and recorded as CUDA graphs; needs a "
        "CUDA device). See the docs' 'Captured steps'",
        default="off",
        choices=CAPTURE_MODES,
        later=True,
        maps_onto=(_TRAINER + "capture",),
    ),
    Setting("no_progress", "hide progress bars", kind="flag"),
    # the choice of the kept weights (config files)
    Setting(
        "metric",
        "validation metric whose best epoch's weights the state keeps (val_loss, val_accuracy, "
        "val_<metrics_fn name>)",
        maps_onto=(_UPDATER + "metric",),
    ),
    Setting(
        "mode",
        "min or max (default: max for a metric named *accuracy, else min)",
        choices=("min", "max"),
        maps_onto=(_UPDATER + "mode",),
    ),
    Setting(
        "early_stopping",
        "stop an update after PATIENCE validations without improvement of --metric",
        kind="int",
        low=1,
        metavar="PATIENCE",
    ),
    Setting(
        "no_validation_memory",
        "validate on this update's validation data only (default: also on earlier ones')",
        kind="flag",
    ),
    # evaluate
    Setting(
        "state",
        "a state folder",
        required=True,
        variants={
            "shift": {
                "help": "test on the features of this state folder's model",
                "required": False,
            },
            "predict": {"help": "the state folder whose model predicts"},
            "info": {"help": "the state folder to describe"},
        },
    ),
    Setting(
        "chunk_ids",
        "with --config-file: the chunks to evaluate on (default: those the state was trained on, "
        "0..updates-1)",
        kind="ints",
        check=list_of_ints(0, None, empty=False, distinct=True),
    ),
    Setting(
        "classifier",
        _classifier_help,
        choices=CLASSIFIERS,
        shown="",
    ),
    # predict
    Setting(
        "output",
        "the file to write: .npz (arrays labels, probabilities) or .csv (label, then one column "
        "per class probability); never an existing file (default: print a summary only)",
    ),
    Setting(
        "probabilities",
        "also write each class's probability (the softmax of the classifier's outputs)",
        kind="flag",
    ),
    # info
    Setting("json", "print one JSON object (its keys are documented) instead of text", kind="flag"),
    # shift
    Setting("reference", ".npz or .safetensors with 'inputs'", required=True),
    Setting("query", ".npz or .safetensors with 'inputs'", required=True),
    Setting("detector", "{default} (default) or ks", default="mmd", choices=("mmd", "ks")),
    Setting(
        "level",
        "significance (default {default})",
        kind="float",
        default=0.05,
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
        maps_onto=("renate_events.shift:ShiftDetector.test.level",),
    ),
    Setting(
        "num_permutations",
        "MMD permutations (default {default})",
        kind="int",
        default=1000,
        low=1,
        high=10**7,
        maps_onto=(_MMD + "num_permutations",),
    ),
    Setting(
        "max_samples",
        "MMD samples per side (default {default})",
        kind="int",
        default=2000,
        low=10,
        high=10**6,
        maps_onto=(_MMD + "max_samples",),
    ),
    Setting(
        "feature_module",
        "with --state: the submodule whose outputs are the features (default: the logits)",
    ),
)

SETTINGS: dict[str, Setting] = {}
"""Every setting by name."""
for _setting in _ALL:
    if _setting.name in SETTINGS:
        raise ValueError(f"the setting {_setting.name!r} is defined twice")
    SETTINGS[_setting.name] = _setting

_TRAINING = (
    "learner",
    "buffer",
    "memory_size",
    "epochs",
    "lr",
    "optimizer",
    "momentum",
    "weight_decay",
    "batch_size",
    "memory_batch_size",
    "device",
    "precision",
    "tf32",
    "channels_last",
    "nonfinite_loss",
    "capture",
    "no_progress",
)
_SELECTION = ("config_file", "metric", "mode", "early_stopping", "no_validation_memory")
_TRACKING = ("tracker", "tracker_dir", "tracking_uri", "tracker_project", "tracker_run_name")

COMMANDS: dict[str, tuple[str, ...]] = {
    "run": (
        *("config", "scenario", "data_dir", "class_order", "blurry", "online", "eval_every"),
        *("no_augment", "chunks", "seeds", "hidden"),
        *("model", "pretrained", "model_args", "output_dir", "overwrite", *_TRAINING, *_SELECTION),
        *_TRACKING,
    ),
    "update": (
        *("config", "input_state", "data", "output_state", "chunk_id", "seed", "in_place"),
        *(
            "overwrite",
            "accept_config_change",
            "task_id",
            "model",
            "model_args",
            "search",
            "search_storage",
        ),
        *("search_study", "search_pruner", "buffer_storage", "scratch_dir", "lock_timeout"),
        *("checkpoint_every", "restart"),
        *(*_TRAINING, *_SELECTION, *_TRACKING),
    ),
    "evaluate": (
        *("state", "data", "scenario", "config_file", "chunk_ids", "data_dir", "class_order"),
        *("seed", "classifier", "device", "accept_config_change", "scratch_dir"),
    ),
    "predict": (
        *("state", "data", "config_file", "chunk_id", "output", "probabilities", "seed"),
        *("device", "accept_config_change", "scratch_dir"),
    ),
    "info": ("state", "json"),
    "shift": (
        *("reference", "query", "detector", "level", "num_permutations", "max_samples", "seed"),
        *("state", "config_file", "accept_config_change", "feature_module"),
    ),
}
"""The settings each command takes, in the order of its help."""

for _command, _names in COMMANDS.items():
    for _name in _names:
        if _name not in SETTINGS:
            raise ValueError(f"the command {_command!r} takes an undefined setting {_name!r}")


def setting(name: str, command: str | None = None) -> Setting:
    """The setting called ``name`` (as ``command`` takes it, when given).

    Raises:
        KeyError: No setting has that name.
    """
    found = SETTINGS[name]
    return found if command is None else found.for_command(command)


def commands_of(name: str) -> tuple[str, ...]:
    """The commands that take the setting ``name``."""
    return tuple(command for command, names in COMMANDS.items() if name in names)
