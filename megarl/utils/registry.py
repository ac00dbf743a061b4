"""Name → function registries: advantage estimators, policy losses, KL estimators, loss
aggregations, reward functions.

Every member of one registry has the same signature, so the trainer looks a function up by its
configured name and calls it; it never writes `if name == "gae"`. Unknown names fail with the list
of valid ones; `"pkg.module:fn"` or `"path/to/file.py:fn"` loads a user function.

Imports only the standard library (no torch, megatron, vLLM or Ray).
"""

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable


class Registry:
    """Functions of one kind, by name; all take the positional parameters `params`."""

    def __init__(self, kind: str, params: tuple[str, ...]):
        self.kind = kind
        self.params = params
        self._fns: dict[str, Callable] = {}

    def register(self, *names: str) -> Callable[[Callable], Callable]:
        """Decorator: `@REGISTRY.register("name", "alias")` adds the function under each name."""

        def add(fn: Callable) -> Callable:
            self._check_signature(fn, names[0] if names else fn.__name__)
            for name in names or (fn.__name__,):
                if name in self._fns and _qualname(self._fns[name]) != _qualname(fn):
                    raise ValueError(f"{self.kind} {name!r} is already registered to {_qualname(self._fns[name])}")
                self._fns[name] = fn
            return fn

        return add

    def get(self, name: str) -> Callable:
        """The function registered as `name`, or the one at dotted path `"pkg.module:fn"`."""
        if name in self._fns:
            return self._fns[name]
        if ":" in name:
            fn = _load_dotted(name, self.kind)
            self._check_signature(fn, name)
            return fn
        raise ValueError(
            f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())} "
            f"(or a dotted path 'pkg.module:function')"
        )

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns

    def _check_signature(self, fn: Callable, name: str) -> None:
        try:
            inspect.signature(fn).bind(*self.params)
        except TypeError as err:
            raise TypeError(f"{self.kind} {name!r} must accept ({', '.join(self.params)}); {err}") from None
        except ValueError:  # builtins without a signature: accept
            pass


def _qualname(fn: Callable) -> str:
    """module.qualname: the same function re-registered on a module reload is not a clash."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _load_dotted(path: str, kind: str) -> Callable:
    target, _, attr = path.rpartition(":")
    module = _load_file(target, kind, path) if target.endswith(".py") else _import(target, kind, path)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"cannot load {kind} {path!r}: {target!r} has no callable {attr!r}")
    return fn


def _import(module_name: str, kind: str, path: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot load {kind} {path!r}: cannot import module {module_name!r}: {err}") from err


def _load_file(file: str, kind: str, path: str):
    """Import a user's .py file as a module (registered in sys.modules so process pools can pickle its functions)."""
    if not os.path.isfile(file):
        raise ValueError(f"cannot load {kind} {path!r}: file {file!r} does not exist (cwd {os.getcwd()})")
    name = f"megarl_user_{kind.replace(' ', '_')}_" + os.path.splitext(os.path.basename(file))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(file))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
