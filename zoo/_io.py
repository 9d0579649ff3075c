"""Atomic file writes: a crash mid-write leaves the previous file intact, never half a file."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a saved file should get the usual permissions
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)


def _fsync_dir(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is flushed.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def existing(path: str | os.PathLike, kind: str, what: str, expected: str = "") -> Path:
    """`path` as a Path if it is a `kind` ("file" or "dir"), else FileNotFoundError / ValueError (a directory) /
    NotADirectoryError saying what is there instead; `what` names the input ("image", "--data"), `expected`
    says what to give (e.g. "an ImageFolder directory or an .npz")."""
    path = Path(path)
    wanted = expected or ("a file" if kind == "file" else "a directory")
    if not path.exists():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist; give {wanted}")
    if kind == "file" and not path.is_file():
        raise ValueError(f"{what} {str(path)!r} is a directory, not a file; give {wanted}")
    if kind == "dir" and not path.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} is a file, not a directory; give {wanted}")
    return path


def load_npy(path: str | os.PathLike, what: str = "array"):
    """The array in the .npy file `path`, never unpickling; a file that is not one (empty, text, pickled objects,
    truncated) is a ValueError naming it."""
    import numpy as np
    path = existing(path, "file", what, "an .npy file written by numpy.save")
    if path.stat().st_size == 0:
        raise ValueError(f"{what} {str(path)!r} is empty (0 bytes); give an .npy file written by numpy.save")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError(f"{what} {str(path)!r} is not an .npy array file (no NumPy header); write one with "
                         "numpy.save(path, array) of numbers")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        if "pickle" in str(e):
            raise ValueError(f"{what} {str(path)!r} holds Python objects, not numbers; save a numeric array "
                             "(e.g. numpy.save(path, array.astype(numpy.float32)))") from None
        raise ValueError(f"{what} {str(path)!r} is not a readable .npy array ({type(e).__name__}: it may be "
                         "truncated); write it again with numpy.save") from None
