"""What a load measured, kept on disk for the next load of the same file on the same
machine: the compute dtype (``dtype=None``), the int8/tiles crossovers, and how a
batch-1 step reads its weights (the single row's kernel, the read-ahead).

Measuring them runs batch-1 decode steps and products, much of a large model's load
time (docs/performance.md), paid again on every start of ``kvpool serve`` or ``kvpool
generate`` although nothing they depend on changed.

A record is kept under a key of everything the figures depend on, so that a change to any
of them measures again: the file (resolved path, size, modification time); the build
(kvpool's version, the native module's name, which carries its sources' hash, torch's
version); the machine (host name, CPU model and the features that choose kernels, as
``KVPOOL_CPU_FEATURES`` narrows them, the kernel variant, the thread count); and the
settings that change a step's speed (OpenMP's, oneDNN's and ATen's instruction-set
caps). Each choice is kept apart under that key (``kind``: the dtype's, and per compute
dtype the crossovers and the single row's), with the figures that decided it, so a load
that takes one from the store reports the same line as the load that measured it, plus
when.

``KVPOOL_MEASURED``: ``kept`` (the default: take a kept choice, else measure and keep it),
``again`` (measure, and replace what is kept), ``off`` (measure, read and keep nothing).
``KVPOOL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvpool``, else ``~/.cache/kvpool``) holds
the records, one JSON file a key under ``measured/``. A record that cannot be read or
written is measured again, silently: the store only saves time, it decides nothing.

Invariant: a choice taken from the store is one that a load with the same key measured;
nothing is kept that was forced (``KVPOOL_INT8_MAX_ROWS``, ``KVPOOL_ONE_ROW``,
``KVPOOL_READ_AHEAD``: the loader does not ask the store then).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("kept", "again", "off")
# Settings that change how fast a step runs, and so which choice wins
SPEED_SETTINGS = (
    "KVPOOL_CPU_FEATURES",
    "KVPOOL_NATIVE_OPENMP",
    "KVPOOL_EMULATE_AVX512",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
)


def mode() -> str:
    """``KVPOOL_MEASURED``'s mode (``kept`` where unset); a ValueError names the modes."""
    value = os.environ.get("KVPOOL_MEASURED", "kept")
    if value not in MODES:
        raise ValueError(f"KVPOOL_MEASURED: one of {', '.join(MODES)}, not {value!r}")
    return value


def store_dir() -> Path | None:
    """Where the records are kept (``KVPOOL_CACHE_DIR``/measured); None where there is
    no such place (no cache directory set and no home directory: a container's user)."""
    try:
        base = os.environ.get("KVPOOL_CACHE_DIR")
        if base:
            return Path(base).expanduser() / "measured"
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    except RuntimeError:  # (Path.home, expanduser: "Could not determine home directory")
        return None
    return root / "kvpool" / "measured"


def load_key(path: Path, variant: str, batch_invariant: bool) -> dict[str, Any]:
    """Everything a load's measurements depend on (the module's docstring lists it)."""
    import torch

    import kvpool
    from kvpool.model.cpu import cpu_features
    from kvpool.model.native import loaded_native_ops

    resolved = Path(path).resolve()
    stat = resolved.stat()
    ops = loaded_native_ops()
    return {
        "file": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "kvpool": kvpool.__version__,
        "native": ops.__name__ if ops is not None else None,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu": cpu_features().summary(),
        "variant": variant,
        "threads": torch.get_num_threads(),
        "batch_invariant": batch_invariant,
        "settings": {name: os.environ[name] for name in SPEED_SETTINGS if name in os.environ},
    }


class MeasuredStore:
    """The records of one load's key. ``get(kind, fields)``: a kept record (a dict, with
    ``measured_at``, seconds since the epoch) or None; ``put(kind, record)`` keeps one.
    Both do nothing under ``KVPOOL_MEASURED=off``; ``get`` returns None under ``again``.
    A kind's name is its label for the load's line, then ``:`` and what sets it apart
    (``crossover: torch.bfloat16 ...``)."""

    def __init__(self, key: dict[str, Any]) -> None:
        self.key = key
        self.mode = mode()
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        where = store_dir()
        if where is None:  # nowhere to keep anything: as KVPOOL_MEASURED=off
            self.mode, where = "off", Path()
        self.path = where / f"{digest[:24]}.json"
        self.taken: dict[str, float] = {}  # the kinds this load took, and when measured

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("key") != self.key:
            return {}  # (another key's digest, however unlikely, or an old layout)
        kinds = data.get("kinds")
        return kinds if isinstance(kinds, dict) else {}

    def get(self, kind: str, fields: dict[str, tuple[type, ...]]) -> dict[str, Any] | None:
        """The kept record of ``kind``, if each of ``fields`` is in it with one of its
        types (a record edited or damaged by hand is measured again)."""
        if self.mode != "kept":
            return None
        record = self._read().get(kind)
        if not isinstance(record, dict):
            return None
        if not all(isinstance(record.get(f, ...), types) for f, types in fields.items()):
            return None
        if not isinstance(record.get("measured_at"), (int, float)):
            return None
        self.taken[kind] = record["measured_at"]
        return record

    def put(self, kind: str, record: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        kinds = self._read()
        kinds[kind] = {**record, "measured_at": time.time()}
        text = json.dumps({"key": self.key, "kinds": kinds}, indent=1, sort_keys=True)
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed: a reader never sees half a record
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".measured-")
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, self.path)
        except OSError:  # (a read-only home, a full disk: the next load measures again)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def provenance(self) -> str | None:
        """A clause for the load's line where choices came from the store: which, when
        they were measured, and how to measure again; None where all were measured now."""
        if not self.taken:
            return None
        labels = list(dict.fromkeys(kind.partition(":")[0] for kind in self.taken))
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(min(self.taken.values())))
        return (
            f"{', '.join(labels)} as measured at a load on {stamp}, kept in "
            f"{self.path.parent} (KVPOOL_MEASURED=again measures again)"
        )
