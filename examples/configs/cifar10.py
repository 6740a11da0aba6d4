"""The reduced ResNet-18 (``nf=20``) on Seq-CIFAR-10: five chunks of two classes each.

Reads the CIFAR-10 *binary version* from the folder named by the environment variable
``RENATE_EVENTS_CIFAR10`` (the folder ``cifar-10-batches-bin`` or the one above it); nothing is
downloaded. Get ``cifar-10-binary.tar.gz`` from https://www.cs.toronto.edu/~kriz/cifar.html and
extract it there. Chunk ``c`` (0 to 4) holds the classes ``2c`` and ``2c + 1``
(:func:`renate_events.scenarios.seq_cifar10`); ``data_fn`` returns its training images with a 10%
validation split, ``test_data_fn`` the official test images of the same classes. Images are kept
as ``uint8`` by the scenario and converted to floats in [0, 1] here.

    export RENATE_EVENTS_CIFAR10=/data/cifar10
    renate-events update --config-file examples/configs/cifar10.py --chunk-id 0 \\
        --output-state state/0
"""

import functools
import os

import torch
from torch.utils.data import TensorDataset

from renate_events.models import build_model
from renate_events.scenarios import seq_cifar10

ENVIRONMENT_VARIABLE = "RENATE_EVENTS_CIFAR10"
NUM_CHUNKS = 5
NUM_CLASSES = 10
VALIDATION_FRACTION = 0.1


def model_fn():
    """GEM's reduced ResNet-18 (stage widths 20, 40, 80, 160)."""
    return build_model("resnet18", num_classes=NUM_CLASSES, nf=20)


def data_path():
    """The CIFAR-10 folder from ``RENATE_EVENTS_CIFAR10``."""
    path = os.environ.get(ENVIRONMENT_VARIABLE)
    if not path:
        raise ValueError(
            f"set {ENVIRONMENT_VARIABLE} to the folder of the CIFAR-10 binary version "
            "(cifar-10-batches-bin, from https://www.cs.toronto.edu/~kriz/cifar.html); "
            "nothing is downloaded"
        )
    return path


@functools.lru_cache(maxsize=2)
def _tasks(path, seed):
    return seq_cifar10(path, seed=seed).tasks()


def _task(chunk_id, seed):
    if not 0 <= chunk_id < NUM_CHUNKS:
        raise ValueError(f"chunk_id must be in [0, {NUM_CHUNKS - 1}], got {chunk_id}")
    return _tasks(data_path(), seed)[chunk_id]


def _as_float(inputs):
    return inputs.to(torch.float32).div_(255.0)


def data_fn(chunk_id, seed):
    """``(train, validation)`` of chunk ``chunk_id``: its training images, 10% held out."""
    inputs, targets = _task(chunk_id, seed).train.tensors
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed))
    cut = int(len(inputs) * VALIDATION_FRACTION)
    validation, train = order[:cut], order[cut:]
    return (
        TensorDataset(_as_float(inputs[train]), targets[train]),
        TensorDataset(_as_float(inputs[validation]), targets[validation]),
    )


def test_data_fn(chunk_id, seed):
    """The official test images of chunk ``chunk_id``'s two classes."""
    inputs, targets = _task(chunk_id, seed).test.tensors
    return TensorDataset(_as_float(inputs), targets)


def loss_fn():
    return torch.nn.CrossEntropyLoss(reduction="none")


def optimizer_fn(params):
    """SGD with DER's learning rate for ER on Seq-CIFAR-10 (0.1)."""
    return torch.optim.SGD(params, lr=0.1)
