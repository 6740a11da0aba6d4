"""Your own CNN on your own ``uint8`` images, with all three transforms.

Images stay ``uint8`` (4x smaller than floats) in the datasets and in the replay buffer; the
transforms make floats per batch on the model's device:

* ``train_transform``: the new data of every training step (a random horizontal flip, then
  floats in [0, 1]);
* ``buffer_transform``: the replayed samples, which the buffer stores raw (``uint8``), through
  the same augmentation;
* ``test_transform``: validation, ``evaluate``, ``predict`` and ``run``'s test data (floats
  only, no randomness).

Leaving one out where the model needs floats is refused before training, naming the transform to
define. The images come from the ``.npz`` file named by ``RENATE_EVENTS_IMAGES`` (``inputs``:
``uint8`` of shape ``(N, 3, 16, 16)``, ``targets``: class ids 0..3); without it, small synthetic
images made with a fixed seed. Chunk ``c`` holds the classes ``c`` and ``c + 1`` (mod 4).

    renate-events update --config-file examples/configs/images_uint8.py --chunk-id 0 \\
        --output-state state/0
    renate-events update --config-file examples/configs/images_uint8.py --chunk-id 1 \\
        --input-state state/0 --output-state state/1
"""

import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

ENVIRONMENT_VARIABLE = "RENATE_EVENTS_IMAGES"
NUM_CLASSES = 4
SHAPE = (3, 16, 16)


def model_fn():
    """A small CNN on 3x16x16 images."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, NUM_CLASSES),
    )


def _images():
    """``(inputs, targets)``: the file's, or 400 synthetic images (brightness per class)."""
    path = os.environ.get(ENVIRONMENT_VARIABLE)
    if path:
        with np.load(path, allow_pickle=False) as saved:
            return torch.from_numpy(saved["inputs"]), torch.from_numpy(saved["targets"]).long()
    generator = torch.Generator().manual_seed(0)
    targets = torch.arange(400) % NUM_CLASSES
    noise = torch.randint(0, 64, (400, *SHAPE), generator=generator)
    return (noise + 60 * targets.view(-1, 1, 1, 1)).to(torch.uint8), targets


def _chunk(chunk_id, seed, part):
    """Part ``part`` (0: train, 1: validation, 2: test) of chunk ``chunk_id``'s images."""
    inputs, targets = _images()
    chosen = (targets == chunk_id % NUM_CLASSES) | (targets == (chunk_id + 1) % NUM_CLASSES)
    inputs, targets = inputs[chosen], targets[chosen]
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed))
    cut = [0, int(0.7 * len(order)), int(0.85 * len(order)), len(order)]
    rows = order[cut[part] : cut[part + 1]]
    return TensorDataset(inputs[rows], targets[rows])


def data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 0), _chunk(chunk_id, seed, 1)


def test_data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed, 2)


def _to_float(images):
    return images.float() / 255


def _augmented(images):
    flipped = torch.rand(len(images), 1, 1, 1, device=images.device) < 0.5
    return torch.where(flipped, images.flip(-1), images).float() / 255


def train_transform():
    return _augmented


def buffer_transform():
    return _augmented


def test_transform():
    return _to_float
