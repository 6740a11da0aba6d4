"""A minimal config file: an MLP on a synthetic four-class problem whose inputs drift a little
with every chunk (no files needed).

    renate-events update --config-file examples/configs/quick_config.py --output-state state/0
    renate-events update --config-file examples/configs/quick_config.py \\
        --input-state state/0 --output-state state/1
    renate-events evaluate --config-file examples/configs/quick_config.py --state state/1
"""

import torch
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 8, 4


def model_fn():
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )


def _chunk(chunk_id, seed, samples):
    generator = torch.Generator().manual_seed(1000 * chunk_id + seed)
    inputs = torch.randn(samples, FEATURES, generator=generator) + 0.2 * chunk_id
    targets = (inputs[:, 0] > 0.2 * chunk_id).long() + 2 * (inputs[:, 1] > 0.2 * chunk_id).long()
    return TensorDataset(inputs, targets)


def data_fn(chunk_id, seed):
    """Chunk ``chunk_id``'s training data and its validation data."""
    return _chunk(chunk_id, seed, 256), _chunk(chunk_id, seed + 1, 64)


def test_data_fn(chunk_id, seed):
    return _chunk(chunk_id, seed + 2, 64)


def optimizer_fn(params):
    return torch.optim.Adam(params, lr=3e-3)


def metrics_fn():
    return {"error": lambda outputs, targets: (outputs.argmax(dim=-1) != targets).float()}
