"""What an optimizer and a scheduler can run: the value rules of a checkpoint's optimizer and
scheduler sections, by class.

:func:`~trainer.state_checks.check_tree` checks a file's sections for kind and shape against the
live objects; this module adds the values: each parameter group's hyperparameters in the range
the optimizer's constructor accepts (Adam's ``betas`` in [0, 1), a learning rate >= 0 and no
larger than the parameters' dtype can hold, ...), every per-parameter state under a name the
optimizer keeps, with the parameter's exact shape (``step`` and other counters one element) and
finite, and each scheduler's factors, periods and counters in their ranges. The rules are kept by
class in :data:`OPTIMIZER_RULES` and :data:`SCHEDULER_RULES`, which cover every optimizer of
``torch.optim`` the trainer can drive (all but ``LBFGS``, whose ``step`` needs a closure) and
every scheduler of ``torch.optim.lr_scheduler``. A checkpoint of another class is refused, naming
the class; :func:`register_optimizer` and :func:`register_scheduler` are the extension point for
one of your own (a subclass of a registered class inherits its rule).

Example:
    >>> import torch
    >>> from trainer.optim_checks import (
    ...     OPTIMIZER_RULES, OptimizerRule, register_optimizer, rule_of, unit_interval)
    >>> class Lion(torch.optim.SGD):  # a subclass inherits SGD's rule...
    ...     pass
    >>> rule_of(OPTIMIZER_RULES, Lion) is OPTIMIZER_RULES[torch.optim.SGD]
    True
    >>> # ... or registers its own: beta in [0, 1), exp_avg of each parameter's shape, no step
    >>> beta = unit_interval(high_open=True)
    >>> rule = OptimizerRule({"beta": beta}, shaped={"exp_avg"}, scalars=())
    >>> register_optimizer(Lion, rule)
    >>> rule_of(OPTIMIZER_RULES, Lion) is rule
    True
    >>> del OPTIMIZER_RULES[Lion]
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs
import torch

from trainer import _runtime
from trainer.checkpoint import show

__all__ = [
    "MAX_COUNT",
    "OPTIMIZER_RULES",
    "SCHEDULER_RULES",
    "GroupCheck",
    "OptimizerRule",
    "SchedulerRule",
    "Value",
    "count",
    "number",
    "one_of",
    "optimizer_value_problems",
    "register_optimizer",
    "register_scheduler",
    "rule_of",
    "scheduler_value_problems",
    "unit_interval",
]

MAX_COUNT = 2**53
"""The largest step, epoch or batch count a checkpoint may hold: the last integer a float64 (and
so JSON in most readers) represents exactly; a run reaching it would take centuries."""


@attrs.frozen
class Value:
    """The rule of one value: ``test`` says whether a value is acceptable, ``expected`` what an
    acceptable value is (for messages: ``"a number in [0, 1)"``)."""

    test: Callable[[Any], bool]
    expected: str


def _real(value: Any) -> float | None:
    """A real number or a one-element tensor as a float; None for anything else, and for an int
    beyond +-2**53 (which torch cannot take as a scalar once it passes 64 bits)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex:
            return None
        return float(value.detach().reshape(()).item())
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_COUNT:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def number(
    low: float = 0.0, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> Value:
    """A finite real number (or one-element tensor) between ``low`` and ``high``."""

    def test(value: Any) -> bool:
        x = _real(value)
        if x is None or not math.isfinite(x):
            return False
        above = x > low if low_open else x >= low
        below = x < high if high_open else x <= high
        return above and below

    left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    if high == math.inf:
        expected = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        expected = f"a number in {left}{low:g}, {high:g}{right}"
    return Value(test, expected)


def unit_interval(*, low_open: bool = False, high_open: bool = False) -> Value:
    """A number in [0, 1] (either end open): a decay factor, a beta, a fraction."""
    return number(0.0, 1.0, low_open=low_open, high_open=high_open)


def count(low: int = 0) -> Value:
    """An int (not a bool) from ``low`` to :data:`MAX_COUNT`."""

    def test(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_COUNT

    return Value(test, f"an int in [{low}, 2**53]")


def one_of(*choices: Any) -> Value:
    """One of ``choices`` (compared with ``==``)."""
    return Value(lambda value: any(value == choice for choice in choices), f"one of {choices}")


def _each(rule: Value, length: int | None = None) -> Value:
    """A list (or tuple) whose every item follows ``rule`` (of ``length`` items, if given)."""

    def test(value: Any) -> bool:
        return (
            isinstance(value, (list, tuple))
            and (length is None or len(value) == length)
            and all(rule.test(item) for item in value)
        )

    size = "" if length is None else f"{length} "
    return Value(test, f"a list of {size}items, each {rule.expected}")


# -- optimizers -----------------------------------------------------------------------------------

GroupCheck = Callable[[Mapping[str, Any]], "str | None"]
"""A rule across the values of one parameter group: the problem, or None."""


def _names(names: Iterable[str]) -> frozenset[str]:
    return frozenset(names)


@attrs.frozen
class OptimizerRule:
    """What an optimizer class can run.

    Attributes:
        hyperparameters: Rules of the parameter-group values (``lr`` and ``initial_lr`` are
            checked for every class: a finite number >= 0 that the parameters' dtype can hold).
        shaped: Per-parameter state with the parameter's exact shape (``exp_avg``).
        scalars: Per-parameter state of one element (``step``): finite, in [0, 2**53].
        factored: Per-parameter state of the parameter's rank, each dimension equal or 1
            (Adafactor's ``row_var``).
        nullable: Per-parameter state that may be null (SGD's ``momentum_buffer`` without
            momentum).
        checks: Further rules across values of one group; each returns a problem or None.
    """

    hyperparameters: Mapping[str, Value]
    shaped: frozenset[str] = attrs.field(default=(), converter=_names)
    scalars: frozenset[str] = attrs.field(default=("step",), converter=_names)
    factored: frozenset[str] = attrs.field(default=(), converter=_names)
    nullable: frozenset[str] = attrs.field(default=(), converter=_names)
    checks: tuple[GroupCheck, ...] = ()


_K = TypeVar("_K")


def rule_of(registry: Mapping[type, _K], cls: type) -> _K | None:
    """The rule registered for ``cls`` or its nearest registered base class, or None."""
    for base in cls.__mro__:
        if base in registry:
            return registry[base]
    return None


# Steps and the other one-element state (NAdam's mu_product, ASGD's eta and mu) are >= 0.
_SCALAR_STATE = number(0.0, MAX_COUNT)
_BETA = unit_interval(high_open=True)
_BETAS = _each(_BETA, 2)
_NON_NEGATIVE = number()
_ADAM = {"betas": _BETAS, "eps": _NON_NEGATIVE, "weight_decay": _NON_NEGATIVE}


def _nesterov(group: Mapping[str, Any]) -> str | None:
    if group.get("nesterov") and not (
        (_real(group.get("momentum")) or 0) > 0 and _real(group.get("dampening")) == 0
    ):
        return "nesterov is true, which needs a momentum > 0 and a dampening of 0"
    return None


def _etas(group: Mapping[str, Any]) -> str | None:
    etas = group.get("etas")
    if etas is None or not (_real(etas[0]) or 0) < 1 < (_real(etas[1]) or 0):
        return f"etas is {show(etas)}, which must be (a, b) with 0 < a < 1 < b"
    return None


OPTIMIZER_RULES: dict[type, OptimizerRule] = {
    torch.optim.SGD: OptimizerRule(
        {"momentum": _NON_NEGATIVE, "dampening": unit_interval(), "weight_decay": _NON_NEGATIVE},
        shaped={"momentum_buffer"},
        scalars=(),
        nullable={"momentum_buffer"},
        checks=(_nesterov,),
    ),
    torch.optim.Adam: OptimizerRule(_ADAM, shaped={"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    torch.optim.AdamW: OptimizerRule(_ADAM, shaped={"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    torch.optim.Adamax: OptimizerRule(_ADAM, shaped={"exp_avg", "exp_inf"}),
    torch.optim.NAdam: OptimizerRule(
        {**_ADAM, "momentum_decay": _NON_NEGATIVE},
        shaped={"exp_avg", "exp_avg_sq"},
        scalars={"step", "mu_product"},
    ),
    torch.optim.RAdam: OptimizerRule(_ADAM, shaped={"exp_avg", "exp_avg_sq"}),
    torch.optim.SparseAdam: OptimizerRule(
        {"betas": _BETAS, "eps": number(low_open=True)}, shaped={"exp_avg", "exp_avg_sq"}
    ),
    torch.optim.RMSprop: OptimizerRule(
        {
            "alpha": _NON_NEGATIVE,
            "eps": _NON_NEGATIVE,
            "weight_decay": _NON_NEGATIVE,
            "momentum": _NON_NEGATIVE,
        },
        shaped={"square_avg", "momentum_buffer", "grad_avg"},
    ),
    torch.optim.Adagrad: OptimizerRule(
        {
            "lr_decay": _NON_NEGATIVE,
            "weight_decay": _NON_NEGATIVE,
            "initial_accumulator_value": _NON_NEGATIVE,
            "eps": _NON_NEGATIVE,
        },
        shaped={"sum"},
    ),
    torch.optim.Adadelta: OptimizerRule(
        {"rho": unit_interval(), "eps": _NON_NEGATIVE, "weight_decay": _NON_NEGATIVE},
        shaped={"square_avg", "acc_delta"},
    ),
    torch.optim.ASGD: OptimizerRule(
        {
            "lambd": _NON_NEGATIVE,
            "alpha": number(-math.inf),
            "t0": number(-math.inf),
            "weight_decay": _NON_NEGATIVE,
        },
        shaped={"ax"},
        scalars={"step", "eta", "mu"},
    ),
    torch.optim.Rprop: OptimizerRule(
        {"etas": _each(number(low_open=True), 2), "step_sizes": _each(_NON_NEGATIVE, 2)},
        shaped={"prev", "step_size"},
        checks=(_etas,),
    ),
    torch.optim.Adafactor: OptimizerRule(
        {
            "beta2_decay": number(-math.inf, 0.0),
            "eps": Value(
                lambda eps: (
                    isinstance(eps, (list, tuple))
                    and len(eps) == 2
                    and (eps[0] is None or _NON_NEGATIVE.test(eps[0]))
                    and _NON_NEGATIVE.test(eps[1])
                ),
                "a pair (null or a finite number >= 0, a finite number >= 0)",
            ),
            "d": number(1.0),
            "weight_decay": _NON_NEGATIVE,
        },
        shaped={"variance"},
        factored={"row_var", "col_var"},
    ),
    torch.optim.Muon: OptimizerRule(
        {
            "momentum": _NON_NEGATIVE,
            "weight_decay": _NON_NEGATIVE,
            "eps": _NON_NEGATIVE,
            "ns_coefficients": _each(number(-math.inf), 3),
            "ns_steps": count(),
            "adjust_lr_fn": one_of(None, "original", "match_rms_adamw"),
        },
        shaped={"momentum_buffer"},
        scalars=(),
    ),
}
"""The rule of each optimizer class, by class (see :func:`register_optimizer`)."""

# Flags of the optimizers' constructors: true, false or null (the optimizer picks), even where the
# live value is null and so shows no kind.
_FLAGS = (
    "foreach",
    "maximize",
    "amsgrad",
    "nesterov",
    "centered",
    "decoupled_weight_decay",
    "capturable",
    "differentiable",
    "fused",
)
_FLAG = Value(lambda value: value is None or isinstance(value, bool), "true, false or null")
# Flags that choose how a step runs: a file may not switch them on for an optimizer that was not
# built with them (a capturable step on CPU parameters fails at its first step).
_IMPLEMENTATION_FLAGS = ("capturable", "differentiable", "fused")
# What schedulers add to the parameter groups.
_SCHEDULED_LRS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULED_MOMENTA = ("base_momentum", "max_momentum")


def register_optimizer(cls: type[torch.optim.Optimizer], rule: OptimizerRule) -> None:
    """Let checkpoints of optimizer class ``cls`` (and its subclasses) load, checked by ``rule``.

    Raises:
        TypeError: ``cls`` is not an optimizer class or ``rule`` not an :class:`OptimizerRule`.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"cls must be a torch.optim.Optimizer subclass, got {cls!r}")
    if not isinstance(rule, OptimizerRule):
        raise TypeError(f"rule must be an OptimizerRule, got {rule!r}")
    OPTIMIZER_RULES[cls] = rule


def _learning_rate(params: list[torch.Tensor]) -> tuple[Value, float]:
    """The rule of a learning rate for ``params`` (finite, >= 0 and no larger than every
    floating-point parameter's dtype can hold: a larger one overflows the step), and that
    largest number."""
    dtypes = {p.dtype for p in params if p.dtype.is_floating_point} or {torch.float32}
    dtype = min(dtypes, key=lambda d: torch.finfo(d).max)
    largest = torch.finfo(dtype).max
    rule = number(0.0, largest)
    return Value(rule.test, f"a finite number >= 0 that {dtype} holds (<= {largest:.4g})"), largest


def _value_problem(value: Any, rule: Value | None, largest: float) -> str | None:
    """What a parameter-group value must be, if it is not: its rule's expectation, and for any
    number one that the parameters' dtype holds (a momentum of 2**70 passes "finite >= 0" and
    fails converting to a float32 scalar in the step)."""
    if rule is not None and not rule.test(value):
        return rule.expected
    x = _real(value)
    huge = isinstance(value, int) and not isinstance(value, bool) and x is None
    if huge or (x is not None and not abs(x) <= largest):
        return f"a number the parameters' dtype holds (|x| <= {largest:.4g})"
    return None


def _group_problems(
    i: int, live: Mapping[str, Any], group: Mapping[str, Any], rule: OptimizerRule
) -> list[str]:
    where = f"optimizer: param_groups[{i}]"
    lr, largest = _learning_rate(list(live["params"]))
    rules = {
        **dict.fromkeys(_SCHEDULED_LRS, lr),
        # a cycled momentum becomes Adam's first beta, which must stay below 1
        **dict.fromkeys(_SCHEDULED_MOMENTA, _BETA if "betas" in group else _NON_NEGATIVE),
        **dict.fromkeys(_FLAGS, _FLAG),
        **rule.hyperparameters,
    }
    problems = [
        f"{where}.{key} is {show(value)} in the file, not {expected}"
        for key, value in group.items()
        if key != "params" and (expected := _value_problem(value, rules.get(key), largest))
    ]
    if problems:
        return problems
    problems += [
        f"{where}.{flag} is true in the file, but the optimizer was built with {flag}="
        f"{live.get(flag)!r} (the flag is the optimizer's, not the checkpoint's)"
        for flag in _IMPLEMENTATION_FLAGS
        if group.get(flag) and not live.get(flag)
    ]
    if not problems:
        problems += [f"{where}: {p}" for check in rule.checks if (p := check(group)) is not None]
    return problems


def _tensor_problem(
    name: str, value: torch.Tensor, param: torch.Tensor, rule: OptimizerRule
) -> str:
    """What is wrong with per-parameter state tensor ``name`` of ``param`` ("" if nothing)."""
    shape = tuple(param.shape)
    if name in rule.scalars:
        fits = value.numel() == 1
    elif name in rule.factored:
        fits = value.dim() == len(shape) and all(a in (b, 1) for a, b in zip(value.shape, shape))
    else:
        fits = tuple(value.shape) == shape
    if not fits:
        return f"has shape {tuple(value.shape)} in the file, the parameter has shape {shape}"
    if name in rule.scalars and not _SCALAR_STATE.test(value):
        return f"is {show(value)} in the file, not {_SCALAR_STATE.expected}"
    if (value.dtype.is_floating_point or value.dtype.is_complex) and not bool(
        torch.isfinite(value).all()
    ):
        return "holds NaN or infinite values in the file"
    return ""


def _state_problems(
    index: str, values: Mapping[str, Any], param: torch.Tensor, rule: OptimizerRule, name: str
) -> list[str]:
    known = rule.shaped | rule.scalars | rule.factored
    problems = []
    for key, value in values.items():
        where = f"optimizer: state {key!r} of parameter {index}"
        if key not in known:
            problems.append(f"{where} is not state that {name} keeps (it keeps {sorted(known)})")
        elif isinstance(value, torch.Tensor):
            problem = _tensor_problem(key, value, param, rule)
            if problem:
                problems.append(f"{where} {problem}")
        elif key in rule.scalars and _SCALAR_STATE.test(value):
            continue
        elif value is not None or key not in rule.nullable:
            problems.append(f"{where} is {show(value)}, not a tensor")
    return problems


def optimizer_value_problems(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    states: Mapping[str, Any],
    params: list[torch.Tensor],
) -> list[str]:
    """Every value of a file's optimizer section that ``optimizer`` cannot run.

    ``groups`` and ``states`` must have the live optimizer's layout (same group sizes, parameter
    ids 0..n-1, values of the live values' kinds): :func:`~trainer.state_checks.check_tree` checks
    that first.
    """
    name = type(optimizer).__qualname__
    rule = rule_of(OPTIMIZER_RULES, type(optimizer))
    if rule is None:
        return [
            f"optimizer: {name} has no value rules, so its checkpoints cannot be checked; "
            "register them with trainer.optim_checks.register_optimizer"
            f"({name}, OptimizerRule(...)) (see docs/checkpoints.rst)"
        ]
    problems = []
    for i, (live, group) in enumerate(zip(optimizer.param_groups, groups)):
        problems += _group_problems(i, live, group, rule)
    for index, values in states.items():
        problems += _state_problems(index, values, params[int(index)], rule, name)
    return problems


# -- schedulers -----------------------------------------------------------------------------------


@attrs.frozen
class SchedulerRule:
    """What a scheduler class can run.

    Attributes:
        values: Rules of the state's values by key (the keys every ``LRScheduler`` keeps,
            ``base_lrs``, ``_last_lr``, ``last_epoch`` and ``_step_count``, are checked for every
            class).
        checks: Further rules comparing the file's state (second argument) with the live
            state (first); each returns a problem or None.
        nested: Whether the state holds the states of the live scheduler's ``_schedulers``
            (``SequentialLR``, ``ChainedScheduler``), each checked by its own class's rule.
    """

    values: Mapping[str, Value] = attrs.field(factory=dict)
    checks: tuple[Callable[[Mapping[str, Any], Mapping[str, Any]], str | None], ...] = ()
    nested: bool = False


_LRS = _each(number())
_LR_LISTS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs")
_COMMON = {
    "base_lrs": _LRS,
    "_last_lr": _LRS,
    "last_epoch": count(-1),
    "_step_count": count(),
}
# torch's "multiplicative factor of learning rate decay": a factor above 1 (a warm-up that grows
# the rate) is a user's choice; one above MAX_FACTOR per step overflows any rate within a run.
MAX_FACTOR = 10.0
_DECAY = number(0.0, MAX_FACTOR)
_EPOCH, _TIMES = count(), count(1)
_MILESTONES = Value(
    lambda milestones: (
        isinstance(milestones, Mapping)
        and all(_EPOCH.test(k) and _TIMES.test(v) for k, v in milestones.items())
    ),
    "a mapping of epochs (ints >= 0) to how often each occurs (ints >= 1)",
)
_lr = torch.optim.lr_scheduler


def _scale_fn(live: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    """``_scale_fn_custom``: null without a custom scale function object, its attributes with."""
    have, got = live.get("_scale_fn_custom"), saved.get("_scale_fn_custom")
    if (got is not None) if have is None else not isinstance(got, Mapping):
        expected = "null" if have is None else "a mapping of the scale function's attributes"
        return f"_scale_fn_custom is {show(got)} in the file, not {expected}"
    return None


def _momenta(live: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    """Cycled momenta: Adam's first beta (below 1) with ``use_beta1``, SGD's momentum (>= 0)."""
    rule = _each(_BETA) if saved.get("use_beta1") else _LRS
    for key in ("base_momentums", "max_momentums"):
        if key in saved and not rule.test(saved[key]):
            return f"{key} is {show(saved[key])} in the file, not {rule.expected}"
    return None


def _one_cycle_steps(live: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    """The schedule cannot be further along than its length."""
    if saved["last_epoch"] > saved["total_steps"]:
        return f"last_epoch is {saved['last_epoch']}, past total_steps {saved['total_steps']}"
    return None


def _lambdas(live: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    """``lr_lambdas``: null for a function (whose state is not saved), the attributes of a
    callable object (loaded into it) otherwise; one per parameter group."""
    have, got = live.get("lr_lambdas"), saved.get("lr_lambdas")
    valid = (
        isinstance(got, list)
        and len(got) == len(have or [])
        and all(
            (b is None) if a is None else isinstance(b, Mapping) for a, b in zip(have or [], got)
        )
    )
    if not valid:
        kinds = ["null" if a is None else "a mapping" for a in have or []]
        return f"lr_lambdas is {show(got)} in the file, not [{', '.join(kinds)}]"
    return None


SCHEDULER_RULES: dict[type, SchedulerRule] = {
    _lr.LambdaLR: SchedulerRule(checks=(_lambdas,)),
    _lr.MultiplicativeLR: SchedulerRule(checks=(_lambdas,)),
    _lr.StepLR: SchedulerRule({"step_size": count(1), "gamma": _DECAY}),
    _lr.MultiStepLR: SchedulerRule({"milestones": _MILESTONES, "gamma": _DECAY}),
    _lr.ExponentialLR: SchedulerRule({"gamma": _DECAY}),
    _lr.ConstantLR: SchedulerRule({"factor": unit_interval(), "total_iters": count()}),
    _lr.LinearLR: SchedulerRule(
        {
            "start_factor": unit_interval(low_open=True),
            "end_factor": unit_interval(),
            "total_iters": count(),
        }
    ),
    _lr.PolynomialLR: SchedulerRule({"total_iters": count(), "power": number(-math.inf)}),
    _lr.CosineAnnealingLR: SchedulerRule({"T_max": count(1), "eta_min": number()}),
    _lr.CosineAnnealingWarmRestarts: SchedulerRule(
        {
            "T_0": count(1),
            "T_i": count(1),
            "T_mult": count(1),
            "T_cur": number(),
            "eta_min": number(),
        }
    ),
    _lr.CyclicLR: SchedulerRule(
        {
            "max_lrs": _LRS,
            "total_size": number(low_open=True),
            "step_ratio": unit_interval(low_open=True),
            "mode": one_of("triangular", "triangular2", "exp_range"),
            "gamma": _DECAY,
            "scale_mode": one_of("cycle", "iterations"),
        },
        checks=(_momenta, _scale_fn),
    ),
    _lr.OneCycleLR: SchedulerRule(
        {"total_steps": count(1), "_anneal_func_type": one_of("cos", "linear")},
        checks=(_one_cycle_steps,),
    ),
    _lr.SequentialLR: SchedulerRule({"_milestones": _each(count())}, nested=True),
    _lr.ChainedScheduler: SchedulerRule(nested=True),
    _lr.ReduceLROnPlateau: SchedulerRule(
        {
            "factor": unit_interval(high_open=True),
            "min_lrs": _LRS,
            "patience": count(),
            "cooldown": count(),
            "cooldown_counter": count(),
            "num_bad_epochs": count(),
            "eps": number(),
            "threshold": number(-math.inf),
            "mode": one_of("min", "max"),
            "threshold_mode": one_of("rel", "abs"),
        }
    ),
}
"""The rule of each scheduler class, by class (see :func:`register_scheduler`)."""


def register_scheduler(cls: type, rule: SchedulerRule) -> None:
    """Let checkpoints of scheduler class ``cls`` (and its subclasses) load, checked by ``rule``.

    Raises:
        TypeError: ``cls`` is not a class or ``rule`` not a :class:`SchedulerRule`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a scheduler class, got {cls!r}")
    if not isinstance(rule, SchedulerRule):
        raise TypeError(f"rule must be a SchedulerRule, got {rule!r}")
    SCHEDULER_RULES[cls] = rule


def scheduler_value_problems(
    scheduler: Any, saved: Mapping[str, Any], where: str = "scheduler"
) -> list[str]:
    """Every value of a file's scheduler state that ``scheduler`` cannot run.

    ``saved`` must have the live state's keys and kinds (checked by
    :func:`~trainer.state_checks.check_tree` first).
    """
    name = type(scheduler).__qualname__
    rule = rule_of(SCHEDULER_RULES, type(scheduler))
    if rule is None:
        return [
            f"{where}: {name} has no value rules, so its checkpoints cannot be checked; "
            "register them with trainer.optim_checks.register_scheduler"
            f"({name}, SchedulerRule(...)) (see docs/checkpoints.rst)"
        ]
    # Learning rates, like the optimizer's, no larger than the parameters' dtype can hold.
    optimizer = getattr(scheduler, "optimizer", None)
    params = _runtime.optimizer_params(optimizer) if optimizer is not None else []
    lr = _learning_rate(params)[0]
    lrs = {key: _each(lr) for key in _LR_LISTS} | {"eta_min": lr}
    rules = {**_COMMON, **rule.values, **{k: v for k, v in lrs.items() if k in saved}}
    problems = [
        f"{where}: {key} is {show(saved[key])} in the file, not {value.expected}"
        for key, value in rules.items()
        if key in saved and not value.test(saved[key])
    ]
    if not problems and rule.checks:
        live = scheduler.state_dict()
        problems += [f"{where}: {p}" for check in rule.checks if (p := check(live, saved))]
    if rule.nested and not problems:
        inner = getattr(scheduler, "_schedulers", [])
        for i, (live, state) in enumerate(zip(inner, saved.get("_schedulers", []))):
            problems += scheduler_value_problems(live, state, f"{where}._schedulers[{i}]")
    return problems
