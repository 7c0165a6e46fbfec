"""Public names a package binds on first use (PEP 562): reading one imports only the submodule
that defines it, so a process that needs one corner of the package (a training rank, a verify
rank) does not pay for the rest."""

import importlib
import sys


def lazy_names(package: str, where: dict[str, str]):
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names ``where`` maps to the
    submodule (relative to it) defining each; a name read once is bound on the package, so the next
    read is a plain attribute."""

    def __getattr__(name):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
