"""The command line's models: its MLP on the digits, zoo models on the image scenarios, and how a
state folder's manifest describes either (every key checked before anything is built)."""

from __future__ import annotations

import inspect
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from renate_events.cli._errors import UsageError, one_line
from renate_events.models import MODELS, build_model
from renate_events.scenarios import IMAGE_SCENARIOS, SCENARIOS, resolve_class_order
from renate_events.settings import setting
from renate_events.state_folder import StateFolderError
from trainer import validators as checks

__all__ = [
    "IMAGE_DATA",
    "MAX_PARAMETERS",
    "SCENARIO_ARGS",
    "check_data_dir",
    "check_same_model",
    "evaluation_tasks",
    "mlp",
    "model_spec",
    "options_text",
    "parameter_count",
    "pretrained_model",
    "resolved_model",
    "scenario_record",
    "scenario_tasks",
    "scenario_variants",
    "spec_transforms",
    "zoo_spec_for_run",
]

MAX_PARAMETERS = 10**9  # 4 GB of float32: the command line builds small MLPs

_SOURCE_FILES = {
    "cifar10": "the CIFAR-10 binary version, DIR/cifar-10-batches-bin/data_batch_1.bin ... "
    "data_batch_5.bin and test_batch.bin (cifar-10-binary.tar.gz from "
    "https://www.cs.toronto.edu/~kriz/cifar.html, extracted with tar xzf "
    "cifar-10-binary.tar.gz -C DIR)",
    "cifar100": "the CIFAR-100 binary version, DIR/cifar-100-binary/train.bin and test.bin "
    "(cifar-100-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, extracted "
    "with tar xzf cifar-100-binary.tar.gz -C DIR)",
    "tinyimagenet": "Tiny-ImageNet's folder layout, DIR/tiny-imagenet-200/wnids.txt, words.txt, "
    "train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt "
    "(tiny-imagenet-200.zip from http://cs231n.stanford.edu/, extracted with unzip "
    "tiny-imagenet-200.zip -d DIR; read with Pillow)",
}
IMAGE_DATA = {
    name: (name.rsplit("-", 1)[1], _SOURCE_FILES[name.rsplit("-", 1)[1]])
    for name in IMAGE_SCENARIOS
}
"""The image scenarios: the transform preset (its normalisation) and the files they read."""
_IMAGE_MODEL = ("resnet18", {"nf": 20})  # GEM's reduced ResNet-18: the default on images
_INFERRED = ("inputs", "num_classes", "in_channels", "image_size")
"""Model arguments the command line takes from the scenario's data, never from --model-args."""
_MAX_LAYERS = 64
"""The most blocks (vit ``depth``) or hidden layers (mlp ``hidden``) a zoo model of the command
line has: building one costs time per layer even on the meta device, so a state folder's
description cannot make a reader build for minutes before its size is checked."""


# -- the command line's MLP -----------------------------------------------------------------------


def mlp(inputs: int, hidden: Sequence[int], classes: int) -> torch.nn.Module:
    """The command line's MLP on feature vectors: ``Linear`` and ``ReLU`` layers in a
    ``Sequential`` (its state folders name the parameters ``0.weight``, ``0.bias``, ...)."""
    layers: list[torch.nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [torch.nn.Linear(width, size), torch.nn.ReLU()]
        width = size
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def _mlp_signature(inputs: int, hidden: Sequence[int], classes: int) -> dict[str, list[Any]]:
    """What :func:`mlp` would record in a manifest, computed without building it."""
    signature: dict[str, list[Any]] = {}
    widths = [inputs, *hidden, classes]
    for layer, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        signature[f"{2 * layer}.weight"] = [[width_out, width_in], "float32"]
        signature[f"{2 * layer}.bias"] = [[width_out], "float32"]
    return signature


def parameter_count(inputs: int, hidden: Sequence[int], classes: int) -> int:
    """The number of parameters of :func:`mlp` with these sizes."""
    widths = [inputs, *hidden, classes]
    return sum(a * b + b for a, b in itertools.pairwise(widths))


# -- the scenario and the model of a run ----------------------------------------------------------


def _check_zoo_args(where: str, args: Mapping[str, Any]) -> None:
    """Every argument an int (``hidden``: a list of ints) of a size the model can be built at."""
    for key, value in args.items():
        if key == "hidden" and isinstance(value, list) and len(value) <= _MAX_LAYERS:
            continue
        if key == "layer_norm_eps":  # vit's, the one number among the arguments
            if not (checks.is_real(value) and 0 < value < 1):
                raise ValueError(f"{where} {key} must be a number in (0, 1), got {value!r}")
            continue
        high = _MAX_LAYERS + 1 if key == "depth" else 2**31
        checks.check_int(f"{where} {key}", value, 0, high)


def check_data_dir(scenario: str | None, data_dir: str | None) -> None:
    """``--data-dir`` goes with an image scenario, and only with one."""
    if scenario in IMAGE_SCENARIOS and data_dir is None:
        raise UsageError(
            f"--scenario {scenario} reads {IMAGE_DATA[scenario][1]}: give --data-dir DIR; "
            "nothing is downloaded"
        )
    if scenario not in IMAGE_SCENARIOS and data_dir is not None:
        where = f"{scenario} uses the bundled digits" if scenario else "is not given"
        raise UsageError(
            f"--data-dir is for the image scenarios {sorted(IMAGE_SCENARIOS)}; --scenario {where}"
        )


def resolved_model(options: Any) -> Any:
    """The run's options with the model, its arguments and ``--hidden`` made explicit, after
    the checks of which scenario, data folder and model go together."""
    image = options.scenario in IMAGE_SCENARIOS
    check_data_dir(options.scenario, options.data_dir)
    if not image and options.no_augment:
        raise UsageError(
            f"--no-augment is for the image scenarios {sorted(IMAGE_SCENARIOS)}; --scenario "
            f"{options.scenario} uses the bundled digits"
        )
    _check_pretrained(options, image)
    pretrained = options.pretrained is not None
    model = options.model or ("vit" if pretrained else _IMAGE_MODEL[0] if image else "mlp")
    args = options.model_args
    if args is None:
        args = dict(_IMAGE_MODEL[1]) if image and options.model is None and not pretrained else {}
    if not image and model != "mlp":
        raise UsageError(
            f"--model {model} takes images; --scenario {options.scenario} gives flat vectors of "
            "features: use --model mlp (with --hidden), or an image scenario "
            f"{sorted(IMAGE_SCENARIOS)}"
        )
    if model == "mlp" and args:
        raise UsageError(
            f"--model-args {args}: the MLP's only arguments are its hidden layer sizes; give "
            "them with --hidden"
        )
    if model != "mlp" and options.hidden is not None:
        raise UsageError(f"--hidden sizes --model mlp; --model {model} takes --model-args")
    inferred = sorted(set(args) & set(_INFERRED))
    if inferred:
        raise UsageError(
            f"--model-args: {inferred} come from the scenario's data (number of classes, image "
            "shape); leave them out"
        )
    hidden = options.hidden
    if hidden is None and model == "mlp":
        hidden = list(setting("hidden").default)
    return attrs.evolve(options, model=model, model_args=args, hidden=hidden)


def _check_pretrained(options: Any, image: bool) -> None:
    """``--pretrained`` goes with ``--model vit`` (or none) on an image scenario, without
    ``--model-args`` (the file gives the architecture)."""
    path = options.pretrained
    if path is None:
        return
    if not image:
        raise UsageError(
            f"--pretrained {path} is a ViT for images; --scenario {options.scenario} gives flat "
            f"vectors of features: use an image scenario {sorted(IMAGE_SCENARIOS)}"
        )
    if options.model not in (None, "vit"):
        raise UsageError(f"--pretrained {path} is a ViT: leave --model out or give --model vit")
    if options.model_args:
        raise UsageError(
            f"--pretrained {path} gives the architecture: leave --model-args "
            f"{options.model_args} out"
        )


def pretrained_model(
    options: Any, tasks: Sequence[Any], classes: int
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``--pretrained``'s ViT with a fresh head of ``classes`` outputs, and what the manifest
    records of it: the zoo's ``vit`` with the file's architecture (the weights are in the state
    folder's checkpoint from then on) and the path it came from."""
    from renate_events.pretrained import PretrainedModelError, pretrained_vit

    path = options.pretrained
    try:
        model = pretrained_vit(path, classes)
    except PretrainedModelError as exc:
        raise UsageError(one_line(exc)) from None
    backbone = model.backbone
    shape = list(tasks[0].train.tensors[0].shape[1:])
    takes = [backbone.in_channels, backbone.image_size, backbone.image_size]
    if takes != shape:
        raise UsageError(
            f"--pretrained {path} takes images of shape {takes}, --scenario {options.scenario} "
            f"gives {shape}"
        )
    args = {
        "num_classes": classes,
        "image_size": backbone.image_size,
        "patch_size": backbone.patch_size,
        "in_channels": backbone.in_channels,
        "dim": backbone.dim,
        "depth": backbone.depth,
        "heads": backbone.heads,
        "mlp_dim": backbone.mlp_dim,
        "layer_norm_eps": backbone.eps,
    }
    spec = {
        "kind": "zoo",
        "name": "vit",
        "args": args,
        "inputs": shape,
        "classes": classes,
        "transforms": IMAGE_DATA[options.scenario][0],
        "augment": not options.no_augment,
        "pretrained": os.path.abspath(path),
    }
    return model, spec


def scenario_variants(options: Any) -> dict[str, Any]:
    """The scenario's own arguments that ``--class-order`` and ``--blurry`` give (those not at
    their default), each refused for a scenario that does not take it (``evaluate`` takes no
    ``--blurry``: the test sets do not depend on it)."""
    given = {"class_order": options.class_order, "blurry": getattr(options, "blurry", 0.0) or None}
    given = {name: value for name, value in given.items() if value is not None}
    if given and options.config_file is not None:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise UsageError(
            f"{flag} is for a named --scenario; with --config-file, data_fn cuts the data"
        )
    factory = {**SCENARIOS, **IMAGE_SCENARIOS}.get(options.scenario)
    takes = inspect.signature(factory).parameters if factory is not None else {}
    for name in given:
        if name not in takes:
            which = sorted(
                n
                for n, f in {**SCENARIOS, **IMAGE_SCENARIOS}.items()
                if name in inspect.signature(f).parameters
            )
            raise UsageError(
                f"--{name.replace('_', '-')} is for the class-incremental scenarios {which}; "
                f"--scenario {options.scenario} keeps every class in every task"
            )
    if "class_order" in given and not given["class_order"].startswith("seed:"):
        parts = given["class_order"].replace(" ", "").split(",")
        if not all(part.isdigit() for part in parts):
            raise UsageError(
                f"--class-order {given['class_order']}: give seed:N or the class ids in order, "
                "comma-separated, such as 3,1,0,2"
            )
        given["class_order"] = [int(part) for part in parts]
    return given


def scenario_tasks(
    scenario: str, data_dir: str | None, seed: int, variants: Mapping[str, Any] | None = None
) -> list[Any]:
    """The tasks of a named scenario (with ``variants``, see :func:`scenario_variants`); an image
    scenario's files missing or corrupt is one line (the reader's message names the file that was
    expected and where to get it), as is a class order that does not fit the data."""
    variants = variants or {}
    shown = "".join(
        f" --{name.replace('_', '-')} {options_text(value)}" for name, value in variants.items()
    )
    if scenario in SCENARIOS:
        try:
            tasks = list(SCENARIOS[scenario](seed=seed, **variants).tasks())
        except (ImportError, ValueError) as exc:
            raise UsageError(f"--scenario {scenario}{shown}: {one_line(exc)}") from None
    else:
        shown = f" --data-dir {data_dir}{shown}"
        try:
            tasks = list(IMAGE_SCENARIOS[scenario](data_dir, seed=seed, **variants).tasks())
        except (ImportError, OSError, ValueError) as exc:
            raise UsageError(f"--scenario {scenario}{shown}: {one_line(exc)}") from None
    if len(tasks) < 2:  # a part of a data set's classes (Tiny-ImageNet: 20 per task)
        raise UsageError(
            f"--scenario {scenario}{shown}: the data gives {len(tasks)} task (classes "
            f"{list(tasks[0].classes) if tasks else []}); a run compares updates (forgetting, "
            "transfer) and needs at least 2"
        )
    return tasks


SCENARIO_ARGS = "scenario_args"
"""The key of a state folder's ``metadata`` that records the run's scenario beyond its name."""


def scenario_record(seed: int, variants: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's manifest records of its scenario besides the name (``metadata.scenario_args``):
    the seed of the split and the variants, so that ``evaluate`` builds the tasks it trained on."""
    return {
        "seed": seed,
        "class_order": variants.get("class_order"),
        "blurry": variants.get("blurry", 0.0),
    }


def _checked_record(path: str, record: Any) -> dict[str, Any]:
    """``metadata.scenario_args`` of the manifest ``path``, every key checked."""
    key = f"{path}: key 'metadata.{SCENARIO_ARGS}"
    if not isinstance(record, dict) or set(record) != {"seed", "class_order", "blurry"}:
        raise StateFolderError(
            f"{key}' must be an object of seed, class_order and blurry, got {record!r}"
        )
    seed = record["seed"]
    if not checks.is_int(seed) or not 0 <= seed < setting("seed").high:
        raise StateFolderError(f"{key}.seed' must be a seed, an int >= 0, got {seed!r}")
    order = record["class_order"]
    valid_list = isinstance(order, list) and all(checks.is_int(c) and c >= 0 for c in order)
    if not (order is None or valid_list or (isinstance(order, str) and order.startswith("seed:"))):
        raise StateFolderError(
            f"{key}.class_order' must be null, 'seed:N' or a list of class ids, got {order!r}"
        )
    blurry = record["blurry"]
    if not checks.is_real(blurry) or not 0 <= blurry <= 1:
        raise StateFolderError(f"{key}.blurry' must be a number in [0, 1], got {blurry!r}")
    return record


def evaluation_tasks(
    state: str, metadata: Mapping[str, Any], options: Any
) -> tuple[list[Any], str | None]:
    """The tasks ``evaluate --scenario`` evaluates on, and a note for stderr or None: with the
    seed and the variants the state folder's run recorded for that scenario (``--seed`` and
    ``--class-order`` may only repeat them: a class order only needs to make the same tasks),
    else with the options' (default seed 0: a folder written before the record, or a run of
    another scenario; the note says so). The caller prints the note once the evaluation ran, so
    that a refusal stays one line."""
    given = scenario_variants(options)
    if metadata.get("scenario") != options.scenario or SCENARIO_ARGS not in metadata:
        seed = setting("seed").default if options.seed is None else options.seed
        note = _unrecorded_note(state, metadata.get("scenario"), options, seed)
        return scenario_tasks(options.scenario, options.data_dir, seed, given), note
    record = _checked_record(os.path.join(state, "manifest.json"), metadata[SCENARIO_ARGS])
    trained = f"{state} was trained on --scenario {options.scenario}"
    if options.seed is not None and options.seed != record["seed"]:
        raise UsageError(
            f"--seed {options.seed}: {trained} with --seed {record['seed']} (its manifest records "
            "it); another seed makes other tasks (where the scenario splits its data, with its "
            "training samples in the test sets): leave --seed out"
        )
    variants = {name: record[name] for name in ("class_order", "blurry") if record[name]}
    tasks = scenario_tasks(options.scenario, options.data_dir, record["seed"], variants)
    mine = given.get("class_order")
    if mine is not None and not _same_tasks(
        options.class_order, mine, record["class_order"], tasks
    ):
        order = record["class_order"]
        shown = (
            "the classes in sorted order"
            if order is None
            else f"--class-order {options_text(order)}"
        )
        raise UsageError(
            f"--class-order {options.class_order}: {trained} with {shown} (its manifest "
            "records it); an order that puts other classes in a task makes other tasks: leave "
            "--class-order out"
        )
    return tasks, None


def _unrecorded_note(state: str, trained: Any, options: Any, seed: int) -> str | None:
    """The note where ``evaluate --scenario`` cannot build the run's tasks: the state folder's
    run was of another scenario, or the folder records no seed and class order (written before
    they were recorded) and the options leave one of them out. Not an error: the evaluation runs
    on the tasks the note names."""
    order = "the sorted classes" if options.class_order is None else "that --class-order"
    used = f"--seed {seed} and {order}"
    if trained is not None and trained != options.scenario:
        text = (
            f"{state} was trained on --scenario {trained}, not {options.scenario}: these tasks "
            f"({used}) are not its run's"
        )
    elif options.seed is None or options.class_order is None:
        text = (
            f"{state} records no seed or class order of its run (written before they were "
            f"recorded); evaluating on {used}: give the run's with --seed and --class-order"
        )
    else:
        return None
    return f"renate-events: note: {text}"


def _same_tasks(text: str, given: Any, recorded: Any, tasks: Sequence[Any]) -> bool:
    """Whether the given class order (``text`` as written) makes the recorded one's tasks: the
    same classes in each task, in task order (the order within a task changes nothing). Each
    order is None (sorted), ``"seed:N"`` or a list of ids, cut into ``len(tasks)`` groups as the
    scenario cuts it."""
    classes = sorted(c for task in tasks for c in task.classes)
    try:
        mine = resolve_class_order(given, classes)
    except ValueError as exc:  # not an order of those classes
        raise UsageError(f"--class-order {text}: {one_line(exc)}") from None

    def groups(order: Any) -> list[set[int]]:
        cut = torch.tensor_split(torch.tensor(order or classes), len(tasks))
        return [set(group.tolist()) for group in cut]

    return groups(mine) == groups(resolve_class_order(recorded, classes))


def options_text(value: Any) -> str:
    """A value as the command line writes it: lists comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def zoo_spec_for_run(options: Any, tasks: Sequence[Any], classes: int) -> dict[str, Any]:
    """What the manifest records of a zoo model on an image scenario: its name, every argument
    (the given ones and those of the data), the image shape and the transforms."""
    name = options.model or _IMAGE_MODEL[0]
    shape = list(tasks[0].train.tensors[0].shape[1:])
    data = {
        "inputs": math.prod(shape),
        "num_classes": classes,
        "in_channels": shape[0],
        "image_size": shape[-1],
        "hidden": options.hidden,
    }
    takes = inspect.signature(MODELS[name]).parameters
    _check_own_arguments(name, takes, options.model_args or {})
    args = {**(options.model_args or {}), **{k: v for k, v in data.items() if k in takes}}
    try:
        _check_zoo_args("--model-args", options.model_args or {})
    except ValueError as exc:
        raise UsageError(one_line(exc)) from None
    spec = {
        "kind": "zoo",
        "name": name,
        "args": args,
        "inputs": shape,
        "classes": classes,
        "transforms": IMAGE_DATA[options.scenario][0],
        "augment": not options.no_augment,
    }
    try:
        size = _state_bytes(_zoo_on_meta(name, args))
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--model-args: {one_line(exc)}") from None
    if size > 4 * MAX_PARAMETERS:
        raise UsageError(
            f"--model {name} with {options.model_args} has {size} bytes of parameters; the "
            f"command line builds models of at most {4 * MAX_PARAMETERS}"
        )
    return spec


def _check_own_arguments(name: str, takes: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """``--model-args`` names only arguments the user gives: the model's, less those the
    command line fills from the scenario's data (the message lists only the user's own)."""
    own = {p: spec for p, spec in takes.items() if p not in (*_INFERRED, "hidden")}
    unknown = sorted(set(given) - set(own))
    if unknown:
        listed = ", ".join(
            p if spec.default is spec.empty else f"{p}={spec.default!r}" for p, spec in own.items()
        )
        rest = f"its own arguments are {listed}" if listed else "it takes no argument of its own"
        raise UsageError(
            f"--model-args: --model {name} does not take {unknown}; {rest} (the command line "
            "fills in the rest from the scenario's data)"
        )


def _zoo_on_meta(name: str, args: Mapping[str, Any]) -> torch.nn.Module:
    """The model built on the meta device: its shapes, with no memory allocated."""
    with torch.device("meta"):
        return build_model(name, **args)


def _state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def spec_transforms(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The batch transforms of a zoo model on images: raw ``uint8`` in the buffer, floats made
    per batch (random crop and flip in training and replay unless ``augment`` is false)."""
    if spec["kind"] != "zoo":
        return {}
    from renate_events.transforms import cifar_test_transform, cifar_train_transform

    test = cifar_test_transform(spec["transforms"])
    size = spec["inputs"][-1]  # the crop keeps the images' size (a resized data set's too)
    train = cifar_train_transform(spec["transforms"], size=size) if spec["augment"] else test
    return {"train_transform": train, "buffer_transform": train, "test_transform": test}


# -- the model a state folder's manifest describes ------------------------------------------------


def model_spec(folder: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The model that ``metadata.model`` describes (the command line's MLP or a zoo model),
    checked against the manifest's ``model``.

    The checkpoint holds the model's parameters, so a description that would need more bytes than
    the checkpoint has is refused before anything is allocated.
    """
    path = os.path.join(folder, "manifest.json")
    spec = manifest["metadata"].get("model")
    if isinstance(spec, dict) and spec.get("kind") == "zoo":
        return _zoo_spec(folder, manifest)
    if not isinstance(spec, dict) or spec.get("kind") != "mlp":
        raise UsageError(
            f"{folder} was not written by renate-events run/update (its manifest has no model "
            "description); load it from Python with ModelUpdater and your own model"
        )
    try:
        checks.check_int(f"{path}: key 'metadata.model.inputs'", spec.get("inputs"), 1)
        checks.check_int(f"{path}: key 'metadata.model.classes'", spec.get("classes"), 1)
        hidden = spec.get("hidden")
        if not isinstance(hidden, list):
            raise checks.WrongTypeError(
                f"{path}: key 'metadata.model.hidden' must be a list, got {hidden!r}"
            )
        for width in hidden:
            checks.check_int(f"{path}: key 'metadata.model.hidden'", width, 1)
    except ValueError as exc:
        raise StateFolderError(str(exc)) from None
    shape = (spec["inputs"], hidden, spec["classes"])
    if _mlp_signature(*shape) != manifest["model"]:
        raise StateFolderError(
            f"{path}: key 'metadata.model' describes another MLP than its key 'model' lists"
        )
    if 4 * parameter_count(*shape) > os.path.getsize(os.path.join(folder, "learner.safetensors")):
        raise StateFolderError(
            f"{path}: key 'metadata.model' describes an MLP larger than the checkpoint beside it"
        )
    return spec


def _zoo_spec(folder: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The zoo model that ``metadata.model`` describes, every key checked; built on the meta
    device first (nothing allocated) so that one larger than the checkpoint is refused. The
    updater then compares its parameters with the manifest's ``model``."""
    path = os.path.join(folder, "manifest.json")
    spec = manifest["metadata"]["model"]
    key = f"{path}: key 'metadata.model"
    try:
        checks.check_one_of(f"{key}.name'", spec.get("name"), tuple(MODELS))
        checks.check_one_of(f"{key}.transforms'", spec.get("transforms"), tuple(_SOURCE_FILES))
        if not isinstance(spec.get("augment"), bool):
            raise checks.WrongTypeError(f"{key}.augment' must be true or false")
        if not isinstance(spec.get("args"), dict):
            raise checks.WrongTypeError(f"{key}.args' must be an object")
        shape = spec.get("inputs")
        if not isinstance(shape, list) or len(shape) != 3:
            raise checks.WrongTypeError(f"{key}.inputs' must be [channels, height, width]")
        for size in shape:
            checks.check_int(f"{key}.inputs'", size, 1, 2**15)
        checks.check_int(f"{key}.classes'", spec.get("classes"), 1)
        if spec["args"].get("num_classes") != spec["classes"]:
            raise ValueError(f"{key}.args.num_classes' must equal its key 'classes'")
        _check_zoo_args(f"{key}.args'", spec["args"])
        shown = {"inputs": math.prod(shape), "in_channels": shape[0], "image_size": shape[-1]}
        for name, value in shown.items():
            if spec["args"].get(name, value) != value:
                raise ValueError(f"{key}.args.{name}' does not fit its key 'inputs' {shape}")
        model = _zoo_on_meta(spec["name"], spec["args"])
    except (ValueError, TypeError) as exc:
        raise StateFolderError(one_line(exc)) from None
    if _state_bytes(model) > os.path.getsize(os.path.join(folder, "learner.safetensors")):
        raise StateFolderError(f"{key}' describes a model larger than the checkpoint beside it")
    return spec


def check_same_model(options: Any, spec: Mapping[str, Any], folder: str) -> None:
    """``update --model/--model-args`` must name the input state's model: an architecture never
    changes between the updates of one state folder."""
    name = "mlp" if spec["kind"] == "mlp" else spec["name"]
    recorded = {} if spec["kind"] == "mlp" else spec["args"]
    if options.model is not None and options.model != name:
        raise UsageError(
            f"--model {options.model}: the state folder {folder} holds a {name} model, and later "
            f"updates keep its architecture; leave --model out, or start a new state folder "
            f"with renate-events run --model {options.model}"
        )
    for key, value in (options.model_args or {}).items():
        if recorded.get(key, None) != value:
            raise UsageError(
                f"--model-args {key} = {value!r}: the state folder {folder} holds a {name} model "
                f"with {key} = {recorded.get(key)!r}, and later updates keep its architecture"
            )
