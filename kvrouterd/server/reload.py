"""Config hot reload: routing policy parameters change in place, on SIGHUP or file change.

``ConfigReloader.reload`` reads the config again the way start-up did (file, then
``KVROUTERD_*`` variables, then the command-line overrides), validates all of it, and hands the
``routing`` and ``extra_routing`` sections to ``Router.reload_routing``, which rebuilds only the
policies whose parameters changed. A config that fails validation changes nothing and is
logged. Other sections (listen, workers, limits, eviction, tls, auth, metrics, ...) need a
restart; a reload that changes them logs which ones and leaves them as they are. TLS files
and the auth token file are re-read on their own when they change (see ``security``).

``watch`` polls the file's stat every ``reload_interval_s``: a Kubernetes ConfigMap volume is
updated by swapping a symlink, which no signal announces.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..config import Config, load_config
from ..errors import ConfigError

__all__ = ["RELOADABLE", "ConfigReloader"]

log = logging.getLogger("kvrouterd.server")

#: Config fields applied by a reload; every other field needs a restart.
RELOADABLE = frozenset({"routing", "extra_routing", "reload_interval_s"})


class ConfigReloader:
    def __init__(
        self,
        router: Any,
        config: Config,
        path: str | None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.router = router
        self.config = config
        self.path = path
        self.overrides = dict(overrides or {})
        self.environ = environ
        #: successful reloads and rejected ones, for logs and tests
        self.applied = 0
        self.rejected = 0
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[int, int] | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload(self) -> list[str]:
        """Apply the current config's routing sections; returns the policies rebuilt."""
        self._stamp = self._file_stamp()
        try:
            new = load_config(self.path, self.overrides, self.environ)
            changed = self.router.reload_routing(new.routing, new.extra_routing)
        except ConfigError as exc:
            self.rejected += 1
            log.error("config reload rejected; nothing changed: %s", exc)
            return []
        ignored = [
            f.name for f in dataclasses.fields(Config)
            if f.name not in RELOADABLE and getattr(new, f.name) != getattr(self.config, f.name)
        ]
        if ignored:
            log.warning("config reload: changes to %s need a restart and were not applied", ", ".join(ignored))
        keep = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(Config) if f.name not in RELOADABLE}
        self.config = dataclasses.replace(new, **keep)
        self.applied += 1
        log.info("config reloaded", extra={"policies_rebuilt": changed, "default_policy": self.router.default_routing})
        return changed

    async def watch(self) -> None:
        """Reload whenever the config file's stat changes; runs until cancelled."""
        while True:
            await asyncio.sleep(self.config.reload_interval_s or 1.0)
            if self.config.reload_interval_s and self._file_stamp() != self._stamp:
                self.reload()
