"""What the engine learned, kept across restarts: one JSON file in the state directory, written atomically.

The file names the model and device it was learned on; a file for another model or device (a cost model of a
different GPU would mislead), or one that is corrupt or truncated, is set aside with a warning and the engine starts
cold. Writing goes to a temporary file in the same directory, then `os.replace`, so a crash mid-write leaves the
previous state whole. A directory that cannot be written is refused at start (`check_state_dir`); one that fails
later (disk full, removed) costs a warning at each save, never a step or a request.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

STATE_FILE = "adaptive_state.json"
VERSION = 1


def check_state_dir(state_dir: str | Path, name: str) -> None:
    """Make the directory if needed and write a scratch file there: a ValueError naming the setting `name` if that
    fails, at start rather than at the first save, minutes into serving."""
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=state_dir):
            pass
    except OSError as exc:
        raise ValueError(f"{name} {str(state_dir)!r} is not a writable directory: {exc}") from None


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write` on a temporary file of its own beside `path`, then move it over `path`: a crash mid-write leaves
    the previous file whole, and two servers saving into one directory never write into the same temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_state(state_dir: str | Path, identity: dict[str, Any], payload: dict[str, Any]) -> Path:
    folder = Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_FILE
    data = json.dumps({"version": VERSION, "identity": identity, "state": payload}).encode()
    write_atomically(path, lambda handle: handle.write(data))
    return path


def load_state(state_dir: str | Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The saved state when it is this model's and device's, else None (a warning says why, unless there is none)."""
    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(), parse_constant=_not_finite)
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("state"), dict):
            raise ValueError(f"not an adaptive state of version {VERSION}")
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        logger.warning("adaptive state %s is unreadable (%s): starting cold", path, exc)
        return None
    if data.get("identity") != identity:
        logger.warning("adaptive state %s was learned on %s, not %s: starting cold", path, data.get("identity"), identity)
        return None
    return data["state"]


def _not_finite(literal: str) -> float:
    """json's NaN and Infinity, which no measured statistic holds: a damaged (or hand-edited) file."""
    raise ValueError(f"{literal} in the state")
