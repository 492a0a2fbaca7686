# SPDX-License-Identifier: Apache-2.0
"""The registry of load-balancing strategies: what ``heterogeneous_config.load_balancing_strategy``
may name.

A strategy is a ``BalancingStrategy``: a name, the traits the rest of the fork reads instead of
comparing names, and ``plan(request)``, its rule for splitting the global batch. The built-in
ones (``uniform``, ``manual``, ``compute_aware``) live with the planner, in
``planning/strategies.py``; a strategy of one's own is one module that subclasses
``BalancingStrategy`` and calls ``register_strategy`` before ``deepspeed.initialize``
(docs/extending.md).

The registry sits in the configuration layer so that a config is checked against it while it is
parsed. The built-in strategies are found the way a plug-in is, by the name of their module
(``BUILTIN_MODULE``), the first time the registry is read: this layer imports nothing above it.
"""

import importlib
import re
import threading

BUILTIN_MODULE = "deepspeed.runtime.heterogeneous.planning.strategies"

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_registry = {}
_lock = threading.RLock()
_builtins_loaded = False


class BalancingStrategy:
    """One way of splitting the global batch over the data-parallel ranks.

    Subclasses set the class attributes and implement ``plan``. Every rank calls ``plan`` with the
    same request and must get the same plan: the rule is a pure function of the request (no
    randomness, no rank-local state), as the fork's collectives depend on it.
    """

    name = ""
    """The value of ``heterogeneous_config.load_balancing_strategy`` that selects it: lower case,
    digits and underscores."""
    label = ""
    """How ``deepspeed env_report --heterogeneous`` shows it (default: the name)."""
    adapts = False
    """Whether the fork measures the ranks and asks this strategy again with measured time models:
    after the profiling steps, at the switch check and, with ``scheduler.dynamic_rebalancing``,
    during training. False: the start-up plan stays (as ``uniform`` and ``manual`` do)."""
    takes_sizes = False
    """Whether it reads ``heterogeneous_config.micro_batch_sizes`` (then required; refused with
    any strategy that does not read them)."""

    def plan(self, request):
        """The ``Plan`` for ``request`` (a ``planning.strategies.PlanRequest``: the ranks' time
        models, the global batch, the gas, memory caps, device names, the user's sizes). Raise
        ``ValueError`` saying what would work when the request cannot be met."""
        raise NotImplementedError(f"strategy {self.name!r} does not implement plan(request)")

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r})"


def register_strategy(strategy, replace=False):
    """Make ``strategy`` (a ``BalancingStrategy`` instance) selectable by its name. A name already
    registered is refused unless ``replace``. Returns the strategy (usable as a class decorator's
    tail: ``register_strategy(MyStrategy())``)."""
    if not isinstance(strategy, BalancingStrategy):
        raise TypeError(f"register_strategy: expected a BalancingStrategy instance, got {type(strategy).__name__}")
    name = strategy.name
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"register_strategy: name {name!r} must be lower case letters, digits and underscores, "
                         "starting with a letter")
    if type(strategy).plan is BalancingStrategy.plan:
        raise TypeError(f"register_strategy: {type(strategy).__name__} does not implement plan(request)")
    with _lock:
        _load_builtins()
        if name in _registry and not replace and _registry[name] is not strategy:
            raise ValueError(f"register_strategy: a strategy named {name!r} is already registered "
                             f"({_registry[name]!r}); pass replace=True to replace it")
        _registry[name] = strategy
    return strategy


def unregister_strategy(name):
    """Remove the strategy registered as ``name`` (tests that register their own clean up with it)."""
    with _lock:
        _load_builtins()
        _registry.pop(name, None)


def strategy_names():
    """The registered names, sorted."""
    with _lock:
        _load_builtins()
        return tuple(sorted(_registry))


def get_strategy(name):
    """The strategy registered as ``name``; a ValueError lists the registered names otherwise."""
    with _lock:
        _load_builtins()
        strategy = _registry.get(name) if isinstance(name, str) else None
    if strategy is None:
        raise ValueError(unknown_strategy_message(name))
    return strategy


def unknown_strategy_message(name):
    names = ", ".join(repr(n) for n in strategy_names())
    return (f"{name!r} is not a registered load-balancing strategy; registered: {names} (a strategy of one's own "
            "is registered with register_strategy before deepspeed.initialize: docs/extending.md)")


def _load_builtins():
    """Import the built-in strategies once (they register themselves). A failed import leaves the
    registry as it was, so that the next read retries and raises the same error, not a duplicate."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        before = dict(_registry)
        try:
            importlib.import_module(BUILTIN_MODULE)
        except BaseException:
            _builtins_loaded = False
            _registry.clear()
            _registry.update(before)
            raise
