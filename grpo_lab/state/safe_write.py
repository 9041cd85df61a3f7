"""Writing a directory so that nothing is lost: the new one is built beside the target and renamed
into place once complete (and flushed to disk), a target holding anything grpo_lab did not write is
refused, an old version moved aside is put back if the rename is interrupted, and what killed writes
leave behind is recognised by a marker and removed."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path


PARTIAL_MARKER = ".grpo_lab_partial"
"""Written first into every directory a save is building: what a killed save leaves behind is
recognised by it, and only such directories are ever removed as leftovers."""


def check_writable(directory: Path, action: str) -> None:
    """Refuse a ``directory`` that is a file, or that cannot be created or written to; the message
    reads "Cannot <action> <directory>: ..."."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"Cannot {action} {directory}: it is a file. Give a directory path.")
    blocked = _unwritable(directory)
    if blocked is not None:
        raise PermissionError(f"Cannot {action} {directory}: {blocked} is not writable. "
                              "Give a directory you can write to.")


def _unwritable(directory: Path) -> Path | None:
    """The folder that keeps ``directory`` from being created or written to, if any: the nearest
    existing one of it and its parents, where it lacks write permission."""
    existing = next((p for p in [directory, *directory.parents] if p.exists()), None)
    return existing if existing is not None and not os.access(existing, os.W_OK | os.X_OK) else None


def _listing(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def named(path) -> Path:
    """``path`` with a last part that names the folder itself ("." and ".." made absolute): the partial
    and moved-aside copies of a save are its siblings, named after it."""
    path = Path(path)
    return Path(os.path.abspath(path)) if path.name in ("", "..") else path


def _previous(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def recover_interrupted_write(target: Path) -> None:
    """Finish what an interrupted replacement of ``target`` left: the previous save, moved aside to
    ``.NAME.old`` just before the new one took its place, is put back where the new one never
    arrived, and removed where it did; leftover partial directories of ``target`` are removed."""
    target = named(target)
    old = _previous(target)
    if old.is_dir() and (old / "COMPLETE").exists():
        if not target.exists():
            os.replace(old, target)
        elif (target / "COMPLETE").exists():
            shutil.rmtree(old, ignore_errors=True)
    if target.parent.is_dir():
        for leftover in target.parent.glob(f".{glob_escape(target.name)}.*"):
            if leftover != old and leftover.is_dir() and (leftover / PARTIAL_MARKER).exists():
                shutil.rmtree(leftover, ignore_errors=True)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def remove_partial_writes(parent: Path, prefix: str) -> None:
    """Remove the partial directories that killed saves of ``parent/<prefix>*`` left behind (each
    carries :data:`PARTIAL_MARKER`); complete saves are never touched."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for leftover in parent.glob(f".{glob_escape(prefix)}*"):
        if leftover.is_dir() and (leftover / PARTIAL_MARKER).exists() and not (leftover / "COMPLETE").exists():
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory's entries) to disk; some file systems refuse it for
    directories, which is then skipped."""
    try:
        descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and the directories themselves: a rename that reaches
    the disk before the data it names would leave an empty checkpoint after a power cut."""
    for path in [*sorted(directory.rglob("*"), reverse=True), directory]:
        _fsync(path)


def atomic_directory_write(target: Path, write, *, own_entries: frozenset[str], overwrite: bool = False) -> Path:
    """Call ``write(tmp_dir)``, then move ``tmp_dir`` to ``target`` in one rename.

    ``target`` must be new, empty, or a grpo_lab save (:func:`check_save_target`; ``overwrite``
    allows any directory). Replacing a save moves the old one aside first; an interruption between
    the two renames puts it back, here or at the next save or load (:func:`recover_interrupted_write`).
    """
    target = named(target)
    recover_interrupted_write(target)
    check_target(target, own_entries, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    old = _previous(target)
    moved_aside = False
    try:
        (tmp / PARTIAL_MARKER).write_text("a save being written; removed once complete\n")
        write(tmp)
        written = sorted(entry.name for entry in tmp.iterdir() if entry.name != PARTIAL_MARKER)
        (tmp / "COMPLETE").write_text(json.dumps({"entries": written}, indent=1) + "\n")
        (tmp / PARTIAL_MARKER).unlink()
        _fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            moved_aside = True
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException as error:
        if moved_aside and not target.exists() and old.exists():
            os.replace(old, target)
        full = isinstance(error, Exception) and _disk_full(error, tmp)
        bytes_written = _size(tmp) if full else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise _disk_full_error(target, bytes_written) from error
        raise
    return target


@contextlib.contextmanager
def full_disk_named(target: Path):
    """Turn a write into ``target`` (not atomic: a model saved in place) that fails on a full disk into
    an error that says so, with the fix."""
    try:
        yield
    except Exception as error:
        if not _disk_full(error, Path(target)):
            raise
        free = _megabytes(shutil.disk_usage(target).free)
        raise OSError(
            errno.ENOSPC, f"Cannot save to {target}: the disk or quota is full ({free} free now), so the files "
            "written there are incomplete. Free space on that disk or save to one with more room, then save again."
        ) from error


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def _disk_full(error: BaseException, where: Path) -> bool:
    """Whether a write failed because the disk (or a quota) is full: an ENOSPC/EDQUOT in its causes, or
    no room left where it wrote (torch's writer reports a full disk as "unexpected pos")."""
    cause = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return shutil.disk_usage(where).free < 1 << 20
    except OSError:
        return False


def _disk_full_error(target: Path, bytes_written: int) -> OSError:
    free = shutil.disk_usage(target.parent).free
    earlier = f"; the save already at {target} is kept as it was" if (target / "COMPLETE").exists() else ""
    needed = _size(target) if earlier else 0
    need = (f"a save there takes about {_megabytes(needed)}" if needed > bytes_written
            else f"it had written {_megabytes(bytes_written)} when the disk filled")
    return OSError(
        errno.ENOSPC,
        f"Cannot save to {target}: the disk or quota is full ({need}, {_megabytes(free)} free now{earlier}). "
        "Free space on that disk or save to one with more room.",
    )


def _megabytes(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def check_target(target: Path, own_entries: frozenset[str], *, overwrite: bool = False) -> None:
    """Refuse to save onto a file, or into an existing directory that holds anything but
    ``own_entries`` and what its COMPLETE marker lists (unless ``overwrite``): replacing it would delete
    what grpo_lab did not write."""
    target = Path(target)
    if target.is_file() or (target.exists() and not target.is_dir()):
        raise FileExistsError(
            f"{target} is a file; a save is a directory. Give a path that does not exist yet (e.g. {target}_save)."
        )
    if target.is_dir() and _holds_the_working_directory(target):
        raise ValueError(
            f"Cannot save to {target}: it is this process's working directory (or a folder above it), which "
            "replacing the save there would move away under the process. Save to another path, or change to "
            "another directory first (os.chdir)."
        )
    own_entries = own_entries | written_entries(target)
    foreign = sorted(p.name for p in target.iterdir() if p.name not in own_entries) if target.is_dir() else []
    if foreign and not overwrite:
        held = ("a grpo_lab save and other files" if (target / "COMPLETE").exists()
                else "other files than a grpo_lab save")
        raise FileExistsError(
            f"{target} is a directory that holds {held} ({_listing(foreign)}); saving there would delete them. Give a "
            "new or empty directory, move them out, or pass overwrite=True to replace the directory "
            "and everything in it."
        )
    blocked = _unwritable(target.parent)  # where the new save is built, then renamed into place
    if blocked is not None:
        raise PermissionError(f"Cannot save to {target}: {blocked} is not writable. Give a directory you can write to.")


def _holds_the_working_directory(directory: Path) -> bool:
    try:
        cwd, folder = Path.cwd().resolve(), directory.resolve()
    except OSError:  # no working directory any more: nothing to protect
        return False
    return cwd == folder or folder in cwd.parents


def written_entries(directory: Path) -> frozenset[str]:
    """The entries a complete save wrote into ``directory``, as its COMPLETE marker lists them (none
    for a marker written before it listed them, or for no marker)."""
    try:
        listed = json.loads((Path(directory) / "COMPLETE").read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()
    return frozenset(name for name in listed if isinstance(name, str)) | {"COMPLETE"}


def first_process() -> bool:
    """Whether this is the launch's first process (``RANK`` 0, or no launcher), known before any
    accelerator exists: the one process that writes checkpoints, and so the one that repairs them."""
    return os.environ.get("RANK", "0") == "0"
