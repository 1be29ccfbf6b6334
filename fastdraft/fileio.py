"""Atomic writes: a reader never sees a half-written file or folder."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp_dir
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes it private
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def check_output_path(path: str | Path, is_dir: bool) -> None:
    """``ValueError`` now, before any long work, if ``atomic_dir`` (``is_dir``) or
    ``atomic_write`` could not write ``path`` later: its parent cannot be created or written,
    or it exists as the other kind of entry."""
    path = Path(path)
    if path.exists() and path.is_dir() != is_dir:
        raise ValueError(f"output {path} exists and is not a {'folder' if is_dir else 'file'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc}") from None
    os.rmdir(probe)


def atomic_write(path: str | Path, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp_path)`` on a temporary sibling of ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | Path, data: Any) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2)))


def fastdraft_home() -> Path:
    """Cache root: ``$FASTDRAFT_HOME``, default ``~/.cache/fastdraft``."""
    return Path(os.environ.get("FASTDRAFT_HOME", Path.home() / ".cache" / "fastdraft")).expanduser()
