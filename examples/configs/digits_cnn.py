"""A small CNN on the 8x8 digits bundled with scikit-learn, as five class-incremental chunks.

Chunk ``c`` (0 to 4) holds the digits ``2c`` and ``2c + 1`` (Split-Digits,
:func:`renate_events.scenarios.split_digits`); images are ``(N, 1, 8, 8)`` floats in [0, 1].
``data_fn`` returns the chunk's training data and a validation split (20%, drawn with ``seed``),
``test_data_fn`` the chunk's test set. Needs scikit-learn (``pip install renate-events[examples]``);
no files are read.

    renate-events update --config-file examples/configs/digits_cnn.py --chunk-id 0 \\
        --output-state state/0
    renate-events update --config-file examples/configs/digits_cnn.py --chunk-id 1 \\
        --input-state state/0 --output-state state/1
"""

import functools

import torch
from torch.utils.data import TensorDataset

from renate_events.scenarios import split_digits

NUM_CHUNKS = 5
NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)
VALIDATION_FRACTION = 0.2


def model_fn():
    """Two 3x3 convolutions, a 2x2 max-pooling and a linear layer to the ten classes."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, NUM_CLASSES),
    )


@functools.lru_cache(maxsize=4)
def _tasks(seed):
    return split_digits(seed=seed).tasks()


def _task(chunk_id, seed):
    if not 0 <= chunk_id < NUM_CHUNKS:
        raise ValueError(f"chunk_id must be in [0, {NUM_CHUNKS - 1}], got {chunk_id}")
    return _tasks(seed)[chunk_id]


def _images(dataset):
    inputs, targets = dataset.tensors
    return inputs.reshape(len(inputs), *IMAGE_SHAPE), targets


def data_fn(chunk_id, seed):
    """``(train, validation)`` of chunk ``chunk_id``: its training samples, 20% held out."""
    inputs, targets = _images(_task(chunk_id, seed).train)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed))
    cut = int(len(inputs) * VALIDATION_FRACTION)
    validation, train = order[:cut], order[cut:]
    return (
        TensorDataset(inputs[train], targets[train]),
        TensorDataset(inputs[validation], targets[validation]),
    )


def test_data_fn(chunk_id, seed):
    """The test samples of chunk ``chunk_id``'s two classes."""
    return TensorDataset(*_images(_task(chunk_id, seed).test))


def loss_fn():
    return torch.nn.CrossEntropyLoss(reduction="none")


def optimizer_fn(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def lr_scheduler_fn(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5), "epoch"


def metrics_fn():
    return {"error": lambda outputs, targets: (outputs.argmax(dim=-1) != targets).float().mean()}
