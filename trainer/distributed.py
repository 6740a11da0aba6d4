"""Data-parallel training with ``torch.distributed``: what :class:`~trainer.Trainer` does per rank.

``Trainer(distributed=...)`` chooses the mode:

* ``"auto"`` (default): use the default process group when one is initialised, else run alone;
* ``"init"``: initialise the process group from ``torchrun``'s environment (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; gloo on CPU, NCCL on CUDA) unless one is
  already initialised;
* ``"off"``: one process, even inside an initialised group.

When distributed, one fit on every rank:

* wraps the model in :class:`~torch.nn.parallel.DistributedDataParallel` for the training steps
  (``trainer.training_model``; ``trainer.model`` and checkpoints keep the user's module, so state
  dict keys get no ``module.`` prefix). A step that calls the bare model instead still trains
  correctly: the trainer then averages the gradients itself after the backward pass;
* shards the training data: a ``DataLoader`` gets a ``DistributedSampler`` (seeded with
  ``Trainer.seed`` or 0, ``set_epoch`` called every epoch); a :class:`~trainer.TensorLoader` gives
  each rank the strided slice ``order[rank::world_size]`` of a permutation drawn from
  ``(seed, epoch)``, identical on every rank. Other iterables are used as they are (shard them
  yourself; every rank must yield the same number of batches);
* averages what it reports: validation metrics are reduced over all ranks' samples, the
  FitResult's ``train_loss`` is the mean of the ranks' last losses;
* meets at *safe points* (after every ``batch_end``, ``epoch_end``, validation and ``train_end``,
  and around every checkpoint write): one small all-reduce carries whether a rank failed, whether
  one asked to stop (``state.should_stop``), and where each rank is. A failure on one rank
  re-raises there and raises :class:`RankFailedError` ("rank r failed: ...") on the others.

Collectives in the step itself (the gradient all-reduce) are not safe points: a rank whose step
raises before the backward pass leaves the others waiting in it until the process group's
timeout (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import warnings
from collections.abc import Iterable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from trainer.data import TensorLoader
from trainer.exceptions import TrainerError, add_note

__all__ = ["MODES", "RUNS_ON", "DistributedContext", "RankFailedError", "is_shared", "resolve"]

MODES = ("auto", "init", "off")
"""Values of ``Trainer(distributed=...)``."""

RUNS_ON = ("all", "rank_zero", "collective")
"""Where a listener runs (its ``runs_on`` class attribute or ``subscribe(runs_on=...)``):
every rank; rank zero only (loggers, progress bars); or every rank at the same point, because it
calls collectives such as :meth:`Trainer.save_checkpoint` (checked to be subscribed identically on
every rank)."""

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MESSAGE_BYTES = 1024

# Where a rank is when it meets the others (the third entry of the safe-point tensor).
PHASES = {
    "train_start": 1,
    "batch_end": 2,
    "epoch_end": 3,
    "validation_end": 4,
    "train_end": 5,
    "checkpoint_states": 6,
    "checkpoint_written": 7,
    "checkpoint_main": 8,
    "failure": 0,
}
_PHASE_NAMES = {code: name for name, code in PHASES.items()}


class RankFailedError(TrainerError):
    """Raised on every other rank when one rank of a distributed fit failed.

    ``rank`` is the failing rank and ``message`` the first line of its error; the failing rank
    itself raises its original error.
    """

    def __init__(self, message: str, *, rank: int, original: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original


@attrs.frozen
class DistributedContext:
    """The rank of this process and how it talks to the others.

    Attributes:
        rank: This process's rank (0 when not distributed).
        world_size: Number of processes (1 when not distributed).
        local_rank: The rank on this machine (``LOCAL_RANK``; picks the CUDA device).
        backend: ``"gloo"``, ``"nccl"``, ... (None when not distributed).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        """True when there is a process group to talk to."""
        return self.backend is not None

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- device and model ------------------------------------------------------------------------

    def device_for(self, requested: str | torch.device) -> str | torch.device:
        """``"auto"`` becomes ``cuda:<local_rank>`` on a distributed CUDA run."""
        if self.enabled and requested == "auto" and torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return requested

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module the training step should call: ``model`` alone, or its DDP wrapper.

        Buffers (batch-norm statistics) are not broadcast on every forward: each rank keeps its
        own, and checkpoints store rank zero's.
        """
        if not self.enabled:
            return model
        ids = [device.index] if device.type == "cuda" else None
        with warnings.catch_warnings():  # rank-local buffers are intended (see above)
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated")
            wrapper = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=ids, broadcast_buffers=False
            )
        wrapper.register_forward_pre_hook(_mark_forward)
        wrapper._trainer_forwarded = False  # type: ignore[assignment]
        return wrapper

    def average_gradients(self, wrapper: torch.nn.Module, optimizer: Any) -> None:
        """After a backward pass: average the gradients unless DDP's forward already did."""
        if not self.enabled:
            return
        if getattr(wrapper, "_trainer_forwarded", False):
            wrapper._trainer_forwarded = False  # type: ignore[assignment]
            return
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- data ------------------------------------------------------------------------------------

    def shard(self, loader: Iterable[Any], seed: int) -> Iterable[Any]:
        """This rank's share of ``loader`` (see the module docstring); ``loader`` when alone.

        Raises:
            TypeError: For a ``DataLoader`` with a custom sampler or batch sampler that is not a
                ``DistributedSampler`` (the trainer cannot know how to split it).
        """
        if not self.enabled:
            return loader
        if isinstance(loader, TensorLoader):
            seed = seed if loader.seed is None else loader.seed
            return attrs.evolve(loader, rank=self.rank, world_size=self.world_size, seed=seed)
        if isinstance(loader, torch.utils.data.DataLoader):
            return self._shard_data_loader(loader, seed)
        return loader

    def _shard_data_loader(
        self, loader: torch.utils.data.DataLoader[Any], seed: int
    ) -> torch.utils.data.DataLoader[Any]:
        sampler = loader.sampler
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            return loader
        plain = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)
        batch_sampler = loader.batch_sampler
        if not isinstance(sampler, plain) or (
            batch_sampler is not None and type(batch_sampler) is not torch.utils.data.BatchSampler
        ):
            raise TypeError(
                f"cannot shard a DataLoader with the sampler {type(sampler).__name__} for "
                f"distributed training ({self.world_size} ranks): each rank must see its own part "
                "of the data. Give the DataLoader a torch.utils.data.DistributedSampler yourself "
                "(the trainer calls its set_epoch every epoch), or use shuffle=True/False"
            )
        distributed: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
            loader.dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=isinstance(sampler, torch.utils.data.RandomSampler),
            seed=seed,
        )
        return torch.utils.data.DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=distributed,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
        )

    @staticmethod
    def set_epoch(loader: Iterable[Any], epoch: int) -> None:
        """Tell a sharded loader which epoch starts (its order depends on it)."""
        target = getattr(loader, "sampler", loader)
        set_epoch = getattr(target, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    # -- reductions ------------------------------------------------------------------------------

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``values`` over the ranks (``values`` alone when not)."""
        if not self.enabled:
            return values
        reduced = values.detach().to(self._device(), torch.float64, copy=True)
        dist.all_reduce(reduced)
        return reduced.to(values.device)

    def mean(self, value: float) -> float:
        """The mean of a Python number over the ranks."""
        if not self.enabled:
            return value
        return float(self.sum(torch.tensor([value], dtype=torch.float64))[0]) / self.world_size

    def same_everywhere(self, text: str, what: str) -> None:
        """Raise unless ``text`` is identical on every rank (compares a digest).

        Raises:
            RuntimeError: Naming ``what`` differs, with this rank's value.
        """
        if not self.enabled:
            return
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self._device())
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if int(both[0]) != -int(both[1]):
            raise _shared(
                RuntimeError(
                    f"{what} differ between ranks (rank {self.rank} has {text}); every rank "
                    "must run the same program: subscribe the same collective listeners in the "
                    "same order"
                )
            )

    # -- safe points -----------------------------------------------------------------------------

    def safe_point(
        self, phase: str, error: BaseException | None = None, stop: bool = False
    ) -> bool:
        """Meet the other ranks; return whether any asked to stop.

        Args:
            phase: Where this rank is (a key of :data:`PHASES`); ranks at different phases are
                out of step, which raises.
            error: This rank's failure, if any; it is shared and the caller re-raises it.
            stop: This rank's ``state.should_stop``.

        Raises:
            RankFailedError: When another rank failed (and this one did not).
            RuntimeError: When the ranks reached different safe points.
        """
        if not self.enabled:
            return stop
        code = PHASES["failure"] if error is not None else PHASES[phase]
        values = [int(error is not None), int(stop), code, -code]
        flags = torch.tensor(values, dtype=torch.int64, device=self._device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed, stopped, high, low = (int(x) for x in flags.tolist())
        if failed:
            if error is not None:
                error._trainer_shared = True  # type: ignore[attr-defined]
            self._exchange_failure(error)
            return bool(stopped)
        if high != -low:
            other = _PHASE_NAMES.get(high if high != code else -low, "?")
            raise _shared(
                RuntimeError(
                    f"the ranks are out of step: rank {self.rank} reached {phase!r} while another "
                    f"reached {other!r}. Every rank must get the same number of batches (shard "
                    "the data with a DistributedSampler or a TensorLoader) and run the same "
                    "collective listeners"
                )
            )
        return bool(stopped)

    def _exchange_failure(self, error: BaseException | None) -> None:
        rows = torch.zeros(self.world_size, _MESSAGE_BYTES, dtype=torch.uint8)
        if error is not None:
            text = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else repr(error)
            raw = text.encode()[: _MESSAGE_BYTES - 1]
            rows[self.rank, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rows = rows.to(self._device())
        dist.all_reduce(rows)
        if error is not None:
            return  # the caller re-raises the original error
        for rank, row in enumerate(rows.cpu()):
            text = bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
            if text:
                raise _shared(
                    RankFailedError(
                        f"rank {rank} failed: {text}; this rank (rank {self.rank}) stopped at the "
                        f"same point. See rank {rank}'s output for the traceback",
                        rank=rank,
                        original=text,
                    )
                )

    def together(self, phase: str, action: Any) -> Any:
        """Run ``action()`` on this rank, then meet the others at the safe point ``phase``.

        Nobody continues before every rank finished its ``action``; a failure on any rank
        raises on all of them (the original error where it happened).
        """
        if not self.enabled:
            return action()
        try:
            result = action()
        except BaseException as exc:
            self.safe_point(phase, error=exc)
            raise
        self.safe_point(phase)
        return result

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank."""
        if not self.enabled:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64, device=self._device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def share_failure(self, error: BaseException) -> None:
        """From an ``except`` clause: tell the other ranks, at their next safe point, that this
        rank failed with ``error`` (once; errors that came from a safe point are not re-sent)."""
        if not self.enabled or is_shared(error):
            return
        try:
            self.safe_point("failure", error=error)
        except Exception as inner:  # never hide the original error
            add_note(error, f"while telling the other ranks: {inner}")


def is_shared(error: BaseException) -> bool:
    """Whether every rank already knows about ``error``."""
    return bool(getattr(error, "_trainer_shared", False))


def _shared(error: BaseException) -> BaseException:
    error._trainer_shared = True  # type: ignore[attr-defined]
    return error


def _mark_forward(module: torch.nn.Module, args: Any) -> None:
    if torch.is_grad_enabled():
        module._trainer_forwarded = True  # type: ignore[assignment]


def resolve(mode: str, timeout: datetime.timedelta | None = None) -> DistributedContext:
    """The :class:`DistributedContext` of this process for ``Trainer(distributed=mode)``.

    Raises:
        RuntimeError: ``"init"`` outside ``torchrun`` (its environment variables are missing).
    """
    if mode == "off" or not dist.is_available():
        if mode == "init":
            raise RuntimeError(
                "Trainer(distributed='init') needs torch.distributed, which this build of torch "
                "lacks; use distributed='off'"
            )
        return DistributedContext()
    if not dist.is_initialized():
        if mode == "auto":
            return DistributedContext()
        missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"Trainer(distributed='init') initialises the process group from torchrun's "
                f"environment, but {missing} are not set; launch with `torchrun "
                "--nproc_per_node=N script.py`, or initialise the group yourself and use "
                "distributed='auto'"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if timeout is None:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, timeout=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=str(dist.get_backend()),
    )
