"""A user's own problem as a config file of functions, read the same way by the CLI and Python.

A config file is a Python file that defines some of these functions (only ``model_fn`` and
``data_fn`` are required). Renate users: the names follow Renate's ``renate_config.py``; the
migration page lists the renames (``data_module_fn`` -> ``data_fn``, ...).

* ``model_fn()``: the ``torch.nn.Module`` to train, fresh (the first update starts from it, later
  ones load the state folder into it);
* ``data_fn(chunk_id, seed)``: the training data of update ``chunk_id``, or the tuple ``(train,
  validation)``; each a ``torch.utils.data.Dataset`` (a ``TensorDataset``, say) or a tuple
  ``(inputs, targets)`` of tensors or NumPy arrays (validation may be None);
* ``test_data_fn(chunk_id, seed)``: the test data of chunk ``chunk_id``, the same kinds;
* ``loss_fn()``: the loss, ``(outputs, targets) -> per-sample losses`` (a ``torch.nn`` loss with
  ``reduction="none"``);
* ``optimizer_fn(params)``: a ``torch.optim.Optimizer`` over ``params``;
* ``lr_scheduler_fn(optimizer)``: a scheduler, or ``(scheduler, "epoch" | "step")``;
* ``listeners()``: a list of listeners subscribed to every update's trainer;
* ``metrics_fn()``: ``{name: fn(outputs, targets) -> scalar tensor}``;
* ``collate_fn(batch)``: the ``DataLoader`` collate function itself;
* ``train_transform()``, ``train_target_transform()``, ``buffer_transform()``,
  ``buffer_target_transform()``, ``test_transform()``: each returns a callable on whole batches.

Every call goes through :class:`ConfigFile`, which checks the parameters when the file is loaded
and each return value when it is called, and turns an exception raised inside the file into a
:class:`ConfigError` that names the function and the file's own line.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "my_config.py")
    >>> _ = open(path, "w").write(
    ...     "import torch\\n"
    ...     "def model_fn():\\n    return torch.nn.Linear(4, 2)\\n"
    ...     "def data_fn(chunk_id, seed):\\n"
    ...     "    g = torch.Generator().manual_seed(seed)\\n"
    ...     "    return torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)\\n")
    >>> config = load_config(path)
    >>> train, validation = config.data(chunk_id=0, seed=1)
    >>> len(train), validation
    (8, None)
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import os
import sys
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch.utils.data import Dataset, TensorDataset

from trainer.files import sha256_of_file

__all__ = ["CONFIG_FUNCTIONS", "REQUIRED", "ConfigError", "ConfigFile", "load_config"]

CONFIG_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "model_fn": (),
    "data_fn": ("chunk_id", "seed"),
    "test_data_fn": ("chunk_id", "seed"),
    "loss_fn": (),
    "optimizer_fn": ("params",),
    "lr_scheduler_fn": ("optimizer",),
    "listeners": (),
    "metrics_fn": (),
    "collate_fn": ("batch",),
    "train_transform": (),
    "train_target_transform": (),
    "buffer_transform": (),
    "buffer_target_transform": (),
    "test_transform": (),
}
"""Every function a config file may define, with the parameters it is called with."""

REQUIRED = ("model_fn", "data_fn")
"""The functions every config file defines."""

RENAMES = {
    "data_module_fn": "data_fn",
    "scheduler_fn": "lr_scheduler_fn",
    "lr_scheduler": "lr_scheduler_fn",
    "metric_fn": "metrics_fn",
    "listener_fn": "listeners",
}
"""Names a Renate user (or a typo) is likely to write, and the name to use instead."""


class ConfigError(ValueError):
    """Raised when a config file is missing, does not load, lacks a function, defines one with
    the wrong parameters, raises inside one, or returns something of the wrong kind."""


def _own_frame(path: str, exc: BaseException) -> str:
    """`` (my_config.py, line 12: return x / 0)`` for the innermost frame inside the file."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": {frame.line.strip()}" if frame.line else ""
    end = getattr(frame, "end_lineno", None)  # Python 3.11+
    if end is None and frame.lineno is not None:
        end = _statement_end(path, frame.lineno)
    if code and end is not None and frame.lineno is not None and end > frame.lineno:
        code += " ..."  # a statement over several lines: its first line only, said so
    return f" ({os.path.basename(path)}, line {frame.lineno}{code})"


def _statement_end(path: str, line: int) -> int | None:
    """The last line of the innermost statement that starts on ``line`` of the file ``path``,
    from its syntax tree (Python 3.10's tracebacks do not say where a statement ends)."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return None
    ends = [
        node.end_lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt) and node.lineno == line and node.end_lineno is not None
    ]
    return min(ends, default=None)


def _execute(path: str) -> Any:
    """Run the file as a module of its own (its folder importable, as for a script)."""
    name = f"_renate_events_config_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: not a Python file that can be loaded")
    module = importlib.util.module_from_spec(spec)
    # Registered under its name, as an imported module is: what looks a class or function up
    # by its ``__module__`` finds it (torch.compile tracing a model's forward, get_type_hints).
    sys.modules[name] = module
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise ConfigError(
            f"{path}: syntax error at line {exc.lineno}: {exc.msg}; fix the file"
        ) from exc
    except BaseException as exc:
        del sys.modules[name]  # a file that does not load leaves nothing behind
        if not isinstance(exc, Exception):
            raise
        raise ConfigError(
            f"{path}: loading the file raised {type(exc).__name__}: {exc}{_own_frame(path, exc)}"
        ) from exc
    finally:
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
    return module


def _check_signature(path: str, name: str, function: Any) -> None:
    if not callable(function):
        raise ConfigError(f"{path}: {name} must be a function, got {type(function).__name__}")
    expected = CONFIG_FUNCTIONS[name]
    try:
        inspect.signature(function).bind(*expected)
    except TypeError:
        wanted = f"{name}({', '.join(expected)})"
        raise ConfigError(
            f"{path}: {name} has the parameters {inspect.signature(function)}, but it is called "
            f"as {wanted}; define it as def {wanted}: ..."
        ) from None
    except ValueError:  # builtins without a signature: accept, the call will tell
        return


def _unknown_names(module: Any) -> list[str]:
    """Top-level functions that look like config functions but are not one (``data_module_fn``,
    ``modle_fn``): user helpers with other names are left alone."""
    unknown = []
    for attribute, value in vars(module).items():
        if attribute in CONFIG_FUNCTIONS or attribute.startswith("_") or not callable(value):
            continue
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported, not defined here
        close = difflib.get_close_matches(attribute, list(CONFIG_FUNCTIONS), n=1, cutoff=0.8)
        if attribute in RENAMES or attribute.endswith("_fn") or close:
            unknown.append(attribute)
    return unknown


def _hint(name: str) -> str:
    if name in RENAMES:
        return f"{name!r} (call it {RENAMES[name]!r})"
    close = difflib.get_close_matches(name, list(CONFIG_FUNCTIONS), n=1, cutoff=0.6)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def load_config(path: str | os.PathLike[str]) -> ConfigFile:
    """Load a config file and check its function names and parameters.

    Raises:
        ConfigError: The file is missing, does not run, lacks ``model_fn`` or ``data_fn``,
            defines an unknown ``*_fn`` (named in the message, with the known names), or a
            function whose parameters do not fit how it is called.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist; give the path of a .py file")
    module = _execute(path)
    functions = {name: getattr(module, name) for name in CONFIG_FUNCTIONS if hasattr(module, name)}
    unknown = _unknown_names(module)
    missing = [name for name in REQUIRED if name not in functions]
    if unknown or missing:
        parts = []
        if missing:
            parts.append(f"it lacks {', '.join(missing)}")
        if unknown:
            parts.append(f"it defines {', '.join(_hint(n) for n in unknown)}, not a known name")
        raise ConfigError(
            f"{path}: {'; '.join(parts)}. A config file defines model_fn and data_fn, and "
            f"optionally {', '.join(n for n in CONFIG_FUNCTIONS if n not in REQUIRED)}"
        )
    for name, function in functions.items():
        _check_signature(path, name, function)
    return ConfigFile(path=path, sha256=sha256_of_file(path), functions=functions)


def _as_dataset(path: str, name: str, value: Any) -> Dataset[Any]:
    if isinstance(value, Dataset):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        tensors = []
        for part in value:
            try:
                tensors.append(torch.as_tensor(part))
            except (TypeError, ValueError, RuntimeError):
                break
        if len(tensors) == 2 and tensors[0].dim() >= 1 and tensors[1].dim() >= 1:
            if len(tensors[0]) != len(tensors[1]):
                raise ConfigError(
                    f"{path}: {name} returned {len(tensors[0])} inputs and {len(tensors[1])} "
                    "targets; give one target per input"
                )
            return TensorDataset(*tensors)
    raise ConfigError(
        f"{path}: {name} must return a torch Dataset or (inputs, targets) arrays, got "
        f"{type(value).__name__}"
    )


def _is_train_and_validation(value: Any) -> bool:
    """``(train, validation)`` rather than ``(inputs, targets)``: a pair whose parts are datasets
    or None, or two ``(inputs, targets)`` tuples."""
    if not (isinstance(value, tuple) and len(value) == 2):
        return False
    if any(part is None or isinstance(part, Dataset) for part in value):
        return True
    return all(isinstance(part, tuple) and len(part) == 2 for part in value)


@attrs.frozen
class ConfigFile:
    """A loaded config file: its path, its SHA-256 and its functions, each called through a
    method that checks what it returns.

    Attributes:
        path: The absolute path of the file.
        sha256: Its SHA-256 (state folders record it to say when a later update used another).
        functions: The config functions it defines, by name.
    """

    path: str
    sha256: str
    functions: Mapping[str, Callable[..., Any]]

    def has(self, name: str) -> bool:
        """Whether the file defines ``name``."""
        return name in self.functions

    def frame_of(self, exc: BaseException) -> str:
        """`` (my_config.py, line 12: return x / 0)`` where ``exc`` was raised inside this file
        (its innermost frame there), else ``""``."""
        return _own_frame(self.path, exc)

    def call(self, name: str, *args: Any) -> Any:
        """Call ``name`` with ``args``; an exception inside it becomes a :class:`ConfigError`
        naming the function and the file's line."""
        try:
            return self.functions[name](*args)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"{self.path}: {name} raised {type(exc).__name__}: {exc}"
                f"{_own_frame(self.path, exc)}"
            ) from exc

    def model(self) -> torch.nn.Module:
        """A fresh model from ``model_fn``."""
        model = self.call("model_fn")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"{self.path}: model_fn must return a torch.nn.Module, got {type(model).__name__}"
            )
        return model

    def data(self, chunk_id: int, seed: int) -> tuple[Dataset[Any], Dataset[Any] | None]:
        """``(train, validation or None)`` of update ``chunk_id`` from ``data_fn``."""
        return self._datasets("data_fn", chunk_id, seed)

    def test_data(self, chunk_id: int, seed: int) -> Dataset[Any] | None:
        """The test data of chunk ``chunk_id``, or None without ``test_data_fn``."""
        if not self.has("test_data_fn"):
            return None
        value = self.call("test_data_fn", chunk_id, seed)
        return _as_dataset(self.path, "test_data_fn", value)

    def _datasets(
        self, name: str, chunk_id: int, seed: int
    ) -> tuple[Dataset[Any], Dataset[Any] | None]:
        value = self.call(name, chunk_id, seed)
        if _is_train_and_validation(value):
            train, validation = value
            if train is None:
                raise ConfigError(f"{self.path}: {name} returned no training data (None)")
            train = _as_dataset(self.path, name, train)
            if validation is not None:
                validation = _as_dataset(self.path, name, validation)
            return train, validation
        return _as_dataset(self.path, name, value), None

    def loss(self) -> Callable[..., torch.Tensor] | None:
        """The loss from ``loss_fn``, or None (the learner's default)."""
        if not self.has("loss_fn"):
            return None
        return self._callable("loss_fn", self.call("loss_fn"))

    def optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
        """The optimizer from ``optimizer_fn(params)``, or None (the default)."""
        if not self.has("optimizer_fn"):
            return None
        optimizer = self.call("optimizer_fn", params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"{self.path}: optimizer_fn must return a torch.optim.Optimizer over params, got "
                f"{type(optimizer).__name__}"
            )
        return optimizer

    def scheduler(self, optimizer: torch.optim.Optimizer) -> tuple[Any, str] | None:
        """``(scheduler, interval)`` from ``lr_scheduler_fn(optimizer)``, or None."""
        if not self.has("lr_scheduler_fn"):
            return None
        value = self.call("lr_scheduler_fn", optimizer)
        scheduler, interval = value if isinstance(value, tuple) else (value, "epoch")
        if not callable(getattr(scheduler, "step", None)) or interval not in ("epoch", "step"):
            raise ConfigError(
                f"{self.path}: lr_scheduler_fn must return a learning-rate scheduler or "
                f"(scheduler, 'epoch' | 'step'), got {value!r}"
            )
        return scheduler, interval

    def listeners(self) -> list[Any]:
        """The listeners from ``listeners()``, or an empty list."""
        if not self.has("listeners"):
            return []
        value = self.call("listeners")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(
                f"{self.path}: listeners must return a list of listener objects, got "
                f"{type(value).__name__}"
            )
        return list(value)

    def metrics(self) -> dict[str, Callable[..., Any]]:
        """``{name: fn(outputs, targets)}`` from ``metrics_fn()``, or an empty dict."""
        if not self.has("metrics_fn"):
            return {}
        value = self.call("metrics_fn")
        ok = isinstance(value, Mapping) and all(
            isinstance(k, str) and k and callable(f) for k, f in value.items()
        )
        if not ok:
            raise ConfigError(
                f"{self.path}: metrics_fn must return {{name: function(outputs, targets)}}, got "
                f"{value!r}"
            )
        return dict(value)

    def collate(self) -> Callable[..., Any] | None:
        """The ``collate_fn`` itself (a function, not a factory), or None."""
        return self.functions.get("collate_fn")

    def transform(self, name: str) -> Callable[..., Any] | None:
        """The callable one of the ``*_transform`` functions returns, or None."""
        if not name.endswith("transform") or name not in CONFIG_FUNCTIONS:
            raise KeyError(f"{name!r} is not a transform function of a config file")
        if not self.has(name):
            return None
        return self._callable(name, self.call(name))

    def _callable(self, name: str, value: Any) -> Callable[..., Any]:
        if not callable(value):
            raise ConfigError(
                f"{self.path}: {name} must return a callable, got {type(value).__name__}"
            )
        return value
