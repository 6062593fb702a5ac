"""Stop requests shared by the instances of one model in one server.

A cancelled ensemble request is stopped by a BLS request carrying its key, and Triton may route
that request to any instance of the `ddtree` model (instance_group count > 1, or one per GPU).
The instance that receives it stops the job if it owns it, and otherwise leaves a marker file
here; every instance looks for markers of its own active keys between engine rounds. Files under
/dev/shm cost microseconds and need no extra process; markers nobody claims expire.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def default_directory(model_name: str) -> Path:
    """One directory per server process (the stubs' parent) and model."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"ddtree-stops-{os.getppid()}-{re.sub(r'[^A-Za-z0-9_-]', '_', model_name)}"


class StopRegistry:
    def __init__(self, directory: str | Path, ttl_s: float = 300.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s

    def post(self, key: str) -> bool:
        """Leave a stop marker for `key` (False for a key that cannot be a request key)."""
        if not KEY_PATTERN.match(key):
            return False
        self.directory.mkdir(parents=True, exist_ok=True)   # another instance may have closed it meanwhile
        (self.directory / key).touch()
        return True

    def close(self, grace_s: float = 1.0) -> None:
        """At an instance's end: drop the markers older than `grace_s` (an owner that still runs claims its markers
        within CANCEL_CHECK_S; older ones name requests that had already ended) and the directory itself once it is
        empty (the model's other instances share it; the last to close removes it): restarts leave nothing behind."""
        now = time.time()
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            self._drop_if_older(name, now, grace_s)
        try:
            self.directory.rmdir()
        except OSError:   # markers of requests still running elsewhere, or already removed
            pass

    def claim(self, active_keys) -> list[str]:
        """Markers for keys among `active_keys`, removed as they are returned; stale markers expire."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        claimed = []
        now = time.time()
        for name in names:
            path = self.directory / name
            if name in active_keys:
                claimed.append(name)
                path.unlink(missing_ok=True)
            else:
                self._drop_if_older(name, now, self.ttl_s)
        return claimed

    def _drop_if_older(self, name: str, now: float, age_s: float) -> None:
        """Remove marker `name` if it is older than age_s seconds (gone already: nothing to do)."""
        path = self.directory / name
        try:
            if now - path.stat().st_mtime > age_s:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
