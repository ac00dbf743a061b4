"""Running code around a module's first import in this process (`megarl.utils.lazy_compile`, `import_cache`).

`FirstImportHook(target, around)`, once installed, finds nothing itself: on the first import of `target` it
removes itself from `sys.meta_path`, asks the other finders for the module, and executes it as
`around(execute, module)`, where `execute(module)` is the loader's own execution. A process that imported
`target` before the hook was installed keeps the normal import.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from typing import Callable


class FirstImportHook(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, around: Callable[[Callable, object], None]):
        self.target, self.around = target, around

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        self.uninstall()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module
        spec.loader.exec_module = lambda module: self.around(execute, module)
        return spec

    def install(self) -> None:
        """Idempotent; nothing if the target is already imported."""
        if self.target not in sys.modules and self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
