"""A plug-in folder: a package whose every module registers something when imported (a
DP release, a kind of statistic, a kind of round), found by its file names as
`common.models.registry` finds networks, so that adding one is adding one file and no
list of names is edited anywhere.

A registry loads its folder before it answers a lookup, and before it accepts a new
registration (a second one of the same name must be refused whichever came first);
the folder's own modules register while it loads, which must not load it again.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from pathlib import Path


class PluginFolder:
    """The modules of `package` (the folder `folder`); names starting with ``_`` are
    helpers, not plug-ins."""

    def __init__(self, package: str, folder: Path) -> None:
        self.package = package
        self.folder = folder
        self._loaded: tuple[str, ...] | None = None
        self._loading = threading.local()
        self._lock = threading.RLock()

    def names(self) -> tuple[str, ...]:
        """The plug-ins' module names, sorted."""
        return tuple(sorted(info.name for info in pkgutil.iter_modules([str(self.folder)])
                            if not info.name.startswith("_")))

    def load(self) -> tuple[str, ...]:
        """Import every plug-in (once per process; a call made by a plug-in while the
        folder loads returns at once); their names, in the order loaded."""
        if self._loaded is not None or getattr(self._loading, "active", False):
            return self._loaded or ()
        with self._lock:
            if self._loaded is None:
                self._loading.active = True
                try:
                    names = self.names()
                    for name in names:
                        importlib.import_module(f"{self.package}.{name}")
                finally:
                    self._loading.active = False
                self._loaded = names
        return self._loaded
