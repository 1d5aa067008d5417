"""The registration hook: what fills core's registries (objective kinds, model families, the config
checks of the layers above) before a config is read.

Core imports nothing above itself, so it cannot name the modules that register; it is given them
as import paths, ``module:function``, and calls each once per process. ``ensure_registered()``
runs Lockstep's own (``training.registry:register_all``) and then every path the environment
variable ``LOCKSTEP_REGISTER`` lists (comma-separated), so that a user's own model family or
objective kind registers without an edit to Lockstep::

    LOCKSTEP_REGISTER=mypkg.family:register python train.py --config my.yaml

core.config's loader calls it before it reads a config, and the registries call it when asked
while still empty (a spawned worker, a notebook), so no entry point has to. It imports no torch:
the registering modules do not (``python train.py --nproc N`` checks a config before torch is
imported).

``import_attr`` resolves the ``module:attr`` paths the registered rows carry (an objective class,
a model family's builder), and ``register_provider`` / ``provider`` hand a lower layer's command
line a function of a layer beside it by name (``python -m experiments runs episodes`` decodes
token ids with the data layer's tokenizer).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from core.exceptions import ConfigError

DEFAULT_REGISTRATIONS = ("training.registry:register_all",)
"""Lockstep's own registering function: every objective kind, model family and config check."""
ENVIRONMENT_VARIABLE = "LOCKSTEP_REGISTER"
"""Comma-separated ``module:function`` paths of further registering functions, called after Lockstep's."""

_CALLED: set[str] = set()
_PROVIDERS: dict[str, str] = {}


def ensure_registered() -> None:
    """Call every registering function not called yet in this process (Lockstep's, then
    LOCKSTEP_REGISTER's, in order). Calling it again calls nothing twice."""
    for path in (*DEFAULT_REGISTRATIONS, *registrations_from_environment()):
        if path in _CALLED:
            continue
        register = import_attr(path, key=ENVIRONMENT_VARIABLE)
        if not callable(register):
            raise ConfigError(f"{ENVIRONMENT_VARIABLE} names {path!r}, which is not a function", key=ENVIRONMENT_VARIABLE,
                              hint="name a function that registers, module:function")
        _CALLED.add(path)
        register()


def registrations_from_environment() -> tuple[str, ...]:
    """The paths LOCKSTEP_REGISTER lists (empty when unset)."""
    text = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return tuple(part.strip() for part in text.split(",") if part.strip())


def import_attr(path: str, *, key: str | None = None) -> Any:
    """The attribute ``attr`` of module ``module`` for ``path`` = ``module:attr``; ConfigError (naming
    ``key``, the setting that named it) when the path is malformed or does not import."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{path!r} is not an import path of the form module:attr", key=key,
                          hint="write the module's dotted name, a colon and the attribute's name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{path!r} does not import: {exc}", key=key,
                          hint="check the module's name and that it is on the Python path") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name} has no attribute {attr!r} (from {path!r})", key=key,
                          hint="check the attribute's name") from None


def register_provider(name: str, path: str) -> None:
    """Name a function by its import path (``module:function``) for ``provider(name)``. The same path
    again does nothing; another path under a registered name is refused."""
    known = _PROVIDERS.get(name)
    if known is not None and known != path:
        raise ConfigError(f"provider {name!r} is registered twice, as {known!r} and {path!r}",
                          hint="register each provider once")
    _PROVIDERS[name] = path


def provider(name: str) -> Any:
    """The function registered as ``name`` (register_provider), imported now."""
    if name not in _PROVIDERS:
        ensure_registered()
    if name not in _PROVIDERS:
        raise ConfigError(f"no provider {name!r} is registered", hint=f"known: {', '.join(sorted(_PROVIDERS)) or 'none'}")
    return import_attr(_PROVIDERS[name])
