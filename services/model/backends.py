"""Registries of swappable backends (attention.py's, moe_backend.py's): a name -> class dict each,
to which a backend that needs an optional package (triton, which CPU installs lack) adds itself
when its module is imported; the registry imports that module only when the backend is asked for."""

import importlib
from collections.abc import Mapping, Sequence
from typing import TypeVar

Backend = TypeVar("Backend")


def registered(kind: str, name: str, registry: Mapping[str, Backend], lazy_modules: Mapping[str, str],
               names: Sequence[str]) -> Backend:
    """registry[name], importing lazy_modules[name] first where that module registers it; a
    ValueError naming the `kind` of backend where `name` is not one of `names` or its module
    cannot be imported."""
    if name not in registry and name in lazy_modules:
        try:
            importlib.import_module(lazy_modules[name])
        except ImportError as error:
            raise ValueError(f"{kind} backend {name!r} cannot be loaded: {error}") from error
    if name not in registry:
        raise ValueError(f"{kind} backend {name!r} is not one of {list(names)}")
    return registry[name]
