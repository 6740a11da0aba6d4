"""A small event-driven PyTorch training loop with ordered listeners and safetensors checkpoints.

``trainer`` knows nothing about continual learning; ``renate_events`` builds on it.

Example:
    >>> from trainer import Trainer
    >>> trainer = Trainer(max_epochs=3)
"""

from trainer.checkpoint import read_checkpoint, write_checkpoint
from trainer.data import TensorLoader
from trainer.events import EVENTS, Events, EventSignal
from trainer.exceptions import (
    CaptureError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    ListenerError,
    MissingPackageError,
    NonFiniteLossError,
    SubscriptionError,
    TrainerError,
)
from trainer.state import ListenerState
from trainer.trainer import FitResult, StepOutput, Trainer, TrainState

__all__ = [
    "EVENTS",
    "CaptureError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "EventSignal",
    "Events",
    "FitResult",
    "ListenerError",
    "ListenerState",
    "MissingPackageError",
    "NonFiniteLossError",
    "StepOutput",
    "SubscriptionError",
    "TensorLoader",
    "TrainState",
    "Trainer",
    "TrainerError",
    "read_checkpoint",
    "write_checkpoint",
]
