"""One run per model: a lock file beside the checkpoints that names its owner.

Two runs on the same ``model`` would overwrite each other's checkpoints and learning-rate file.
The chief of a run creates ``<model>.lock`` (``O_EXCL``) holding its host, pid and start time,
and what tells its process from a later one with the same pid (the kernel's boot id and the
process's start in clock ticks since boot, from ``/proc``), and keeps its modification time fresh
from a thread; a second run that finds it stops with one line naming the owner (bad input: exit
status 2, nothing written). A lock is stale, and is taken over with a log line, when its process
is gone (same host): no process has its pid, or the one that has it started at another time or
before another boot (a pid reused after a restart, e.g. pid 1 in a restarted container); or it
was not refreshed for :data:`STALE_SECONDS` (another host, whose processes cannot be seen from
here: a crashed or preempted job's lock does not block its resubmission for longer than that;
also a lock of this host without the process identity, written by an older version or where
``/proc`` does not say, whose live pid may be another process's).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Optional

from returnn_tpu.errors import ConfigError

REFRESH_SECONDS = 30.0  # how often the owner touches its lock
STALE_SECONDS = 120.0  # a lock of another host not touched this long is stale


def _process_identity(pid: int) -> str:
    """What tells process ``pid`` from another that gets the same pid later: the boot id and the
    process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); "?" where
    ``/proc`` does not say (then a live pid counts as the owner)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) is in parentheses and may hold spaces: count after it.
            start = f.read().rsplit(")", 1)[1].split()[19]
        return f"{boot}/{start}"
    except (OSError, IndexError):
        return "?"


class ModelLock:
    """The lock of the run that trains ``model_filename``; :meth:`release` (or the process's end)
    frees it."""

    def __init__(self, model_filename: str, log_file=None):
        self.path = model_filename + ".lock"
        self._stop = threading.Event()
        owner = f"{socket.gethostname()} {os.getpid()} {time.time():.0f} {_process_identity(os.getpid())}\n"
        if os.path.isdir(self.path):
            raise ConfigError(f"model {model_filename!r}: {self.path} is a folder, not a lock file; remove it")
        for _ in range(2):  # the second time after a stale lock was removed
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                why = self._stale()
                if why is None:
                    raise ConfigError(f"model {model_filename!r} is in use by another returnn-tpu run "
                                      f"({self._describe()}); wait for it to end, or remove {self.path} if it is gone")
                print(f"returnn-tpu: taking over the lock {self.path} ({why})", file=log_file)
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass  # another run took it over first; the next attempt says so
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(owner)
            except OSError as exc:  # a full disk: training would fail at its first checkpoint, and say so
                os.remove(self.path)
                print(f"returnn-tpu: warning: cannot write the lock {self.path} ({exc.strerror}); running without it",
                      file=log_file)
                self.path = None
                return
            threading.Thread(target=self._refresh, name="returnn_tpu model lock", daemon=True).start()
            return
        raise ConfigError(f"model {model_filename!r}: could not take the lock {self.path}; another run is starting")

    def _owner(self) -> Optional[tuple]:
        """``(host, pid, start time, process identity or None)`` of the lock's writer."""
        try:
            with open(self.path) as f:
                fields = f.read().split()
            host, pid, since = fields[:3]
            return host, int(pid), float(since), " ".join(fields[3:]) or None  # None: written by an older version
        except (OSError, ValueError):
            return None  # being written, or garbage

    def _describe(self) -> str:
        owner = self._owner()
        if not owner:
            return f"lock file {self.path}"
        host, pid, since, _ = owner
        return f"host {host}, pid {pid}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"

    def _stale(self) -> Optional[str]:
        """Why the existing lock is stale, or None if its owner may still run."""
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return "it was just released"
        owner = self._owner()
        if owner is None:
            return f"unreadable, {age:.0f} s old" if age > STALE_SECONDS else None
        host, pid, _, identity = owner
        if host == socket.gethostname():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"its process {pid} on this host is gone"
            except PermissionError:
                pass  # another user's running process
            if identity in (None, "?"):  # an older version's lock, or no /proc: the live pid may be another's
                return f"its pid {pid} lives, but it was not refreshed for {age:.0f} s" if age > STALE_SECONDS else None
            if _process_identity(pid) != identity:
                return f"its process {pid} on this host is gone (pid {pid} is now another process)"
            return None
        return f"host {host} did not refresh it for {age:.0f} s" if age > STALE_SECONDS else None

    def _refresh(self):
        while not self._stop.wait(REFRESH_SECONDS):
            try:
                os.utime(self.path)
            except OSError:
                return  # removed by hand: nothing to keep fresh

    def release(self):
        self._stop.set()
        if self.path is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
