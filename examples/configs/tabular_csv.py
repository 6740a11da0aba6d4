"""An MLP on a CSV file of numeric features, as a data-incremental stream of row blocks.

Reads the CSV named by the environment variable ``RENATE_EVENTS_CSV``; without it, the small file
shipped next to this one, ``data/tabular.csv`` (800 rows of a synthetic three-class problem whose
features drift from block to block, made with a fixed seed). The file has a header row of column
names, numeric feature columns and an integer ``label`` column (class ids ``>= 0``); it is read
with the ``csv`` module, nothing else is needed.

The rows, in file order, are cut into ``NUM_CHUNKS`` = 4 consecutive blocks of (almost) equal
size: chunk ``c`` is block ``c``, as if a new block of data arrived for every model update. Each
block is split at random (drawn with ``seed``) into 70% training, 15% validation
(``data_fn``) and 15% test (``test_data_fn``) rows.

    renate-events update --config-file examples/configs/tabular_csv.py --chunk-id 0 \\
        --output-state state/0
    RENATE_EVENTS_CSV=my.csv renate-events update --config-file examples/configs/tabular_csv.py \\
        --chunk-id 1 --input-state state/0 --output-state state/1
"""

import csv
import functools
import math
import os

import torch
from torch.utils.data import TensorDataset

ENVIRONMENT_VARIABLE = "RENATE_EVENTS_CSV"
DEFAULT_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tabular.csv")
LABEL_COLUMN = "label"
NUM_CHUNKS = 4
NUM_CLASSES = 3
FRACTIONS = (0.7, 0.15, 0.15)  # train, validation, test of every chunk


def csv_path():
    """``RENATE_EVENTS_CSV`` if set, else the shipped ``data/tabular.csv``."""
    return os.environ.get(ENVIRONMENT_VARIABLE) or DEFAULT_CSV


def _number(path, line, column, text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{path}, line {line}: column {column!r} is {text!r}, not a finite number")
    return value


def _label(path, line, text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < NUM_CLASSES:
        raise ValueError(
            f"{path}, line {line}: {LABEL_COLUMN!r} is {text!r}, not a class id in "
            f"0..{NUM_CLASSES - 1}"
        )
    return value


@functools.lru_cache(maxsize=4)
def read_csv(path):
    """``(features, labels, feature_names)`` of the file: float32 ``(N, F)``, int64 ``(N,)``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such CSV file (set {ENVIRONMENT_VARIABLE})")
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    if not rows or LABEL_COLUMN not in rows[0]:
        raise ValueError(
            f"{path}: the header row must name the columns, one of them {LABEL_COLUMN!r}"
        )
    header, body = rows[0], [row for row in rows[1:] if row]
    where = header.index(LABEL_COLUMN)
    names = tuple(name for i, name in enumerate(header) if i != where)
    if not names or len(body) < NUM_CHUNKS:
        raise ValueError(
            f"{path}: needs at least one feature column and {NUM_CHUNKS} rows, got "
            f"{len(names)} features and {len(body)} rows"
        )
    features, labels = [], []
    for line, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}, line {line}: {len(row)} values for {len(header)} columns")
        features.append(
            [_number(path, line, header[i], v) for i, v in enumerate(row) if i != where]
        )
        labels.append(_label(path, line, row[where]))
    return torch.tensor(features, dtype=torch.float32), torch.tensor(labels), names


def _split(chunk_id, seed):
    if not 0 <= chunk_id < NUM_CHUNKS:
        raise ValueError(f"chunk_id must be in [0, {NUM_CHUNKS - 1}], got {chunk_id}")
    features, labels, _ = read_csv(csv_path())
    rows = torch.tensor_split(torch.arange(len(labels)), NUM_CHUNKS)[chunk_id]
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
    train_end = int(len(rows) * FRACTIONS[0])
    validation_end = train_end + int(len(rows) * FRACTIONS[1])
    parts = (rows[:train_end], rows[train_end:validation_end], rows[validation_end:])
    return [TensorDataset(features[part], labels[part]) for part in parts]


def model_fn():
    """An MLP from the zoo, sized by the CSV's feature columns."""
    from renate_events.models import mlp

    return mlp(len(read_csv(csv_path())[2]), num_classes=NUM_CLASSES, hidden=[64, 64])


def data_fn(chunk_id, seed):
    """``(train, validation)`` rows of block ``chunk_id``."""
    train, validation, _ = _split(chunk_id, seed)
    return train, validation


def test_data_fn(chunk_id, seed):
    """The test rows of block ``chunk_id``."""
    return _split(chunk_id, seed)[2]


def optimizer_fn(params):
    return torch.optim.Adam(params, lr=3e-3)
