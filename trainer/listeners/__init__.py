"""Ready-made listeners.

Each is an attrs class; subscribe an instance with ``trainer.subscribe(...)``. The :class:`Timer`
needs two places in the dispatch order: subscribed, it attaches itself at the first
``train_start``; ``timer.attach(trainer)`` attaches it at once.

* :class:`ProgressBar`: a tqdm bar per epoch (needs ``tqdm``).
* :class:`MetricsLogger`: training and validation scalars to a CSV or JSON-lines file.
* :class:`TensorBoardLogger`: the same scalars to TensorBoard (needs ``tensorboard``).
* :class:`MLflowLogger`: the same scalars, per-epoch means, hyperparameters and artifacts to an
  MLflow run (needs ``mlflow``).
* :class:`WandbLogger`: the same to a Weights & Biases run (needs ``wandb``).
* :class:`ExperimentTracker`: the base of these three trackers.
* :class:`ModelCheckpoint`: periodic, last and best checkpoints, keeping the last K.
* :class:`EarlyStopping`: ends the fit when a validation metric stops improving.
* :class:`LearningRateMonitor`: the learning rate of every parameter group, step by step.
* :class:`Timer`: host wall time spent in the listeners of each event.

The loggers read Python numbers from the device only every ``log_every_n_steps`` batches: in
between they add the losses up on the device, so that they add no host synchronisation to the
other steps. They keep no state in checkpoints, so they can be added to or removed from a run
between a save and a resume; :class:`ModelCheckpoint` and :class:`EarlyStopping` do keep theirs.
"""

from trainer.listeners.early_stopping import EarlyStopping
from trainer.listeners.lr_monitor import LearningRateMonitor
from trainer.listeners.metrics_logger import MetricsLogger
from trainer.listeners.mlflow_logger import MLflowLogger
from trainer.listeners.model_checkpoint import ModelCheckpoint
from trainer.listeners.progress import ProgressBar
from trainer.listeners.tensorboard import TensorBoardLogger
from trainer.listeners.timer import Timer
from trainer.listeners.tracker import ExperimentTracker, flat_params
from trainer.listeners.wandb_logger import WandbLogger

__all__ = [
    "EarlyStopping",
    "ExperimentTracker",
    "LearningRateMonitor",
    "MLflowLogger",
    "MetricsLogger",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoardLogger",
    "Timer",
    "WandbLogger",
    "flat_params",
]
