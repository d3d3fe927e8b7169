"""The offload directory of one process: chosen from the config (one per rank with several
processes), checked before any work starts (preflight: writable, O_DIRECT, free space; no files another
run kept there), locked for the run, and cleaned up at its end, removing only what this run created."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.offload.preflight import (
    LOCK_NAME,
    Leftover,
    OffloadDirLock,
    PreflightReport,
    clear_leftovers,
    new_owner,
    preflight,
    refuse_kept_files,
)


class OffloadDirectory:
    def __init__(self, config: OffloadConfig, setting: str | None = None, owner: str | None = None) -> None:
        """``setting``: the configured directory (one of ``offload.path``'s); None: the default. ``owner``:
        the strategy this run belongs to (its lock record's; None: a new one): files kept there
        (``keep_files``) under the same owner are this run's own, under another's they are refused."""
        self.config = config
        self.setting = setting
        self.owner = owner if owner is not None else new_owner()
        self.path: Path | None = None
        self._lock: OffloadDirLock | None = None
        self._created: Path | None = None
        """The directory, when this run created it (removed at cleanup, when empty)."""
        self._created_rank_parent: Path | None = None
        """The default parent of the per-rank directories: whichever rank leaves last removes it."""
        self.leftovers: list[Leftover] = []
        """What killed runs had left beside this run's directory, removed at :meth:`prepare`."""

    def _choose(self, default_root: Path, rank: int, local_rank: int, distributed: bool) -> Path:
        setting = self.setting
        path = Path(setting or default_root / "greedysnake_offload")
        if setting is not None and ("{rank}" in setting or "{local_rank}" in setting):
            try:
                return Path(setting.format(rank=rank, local_rank=local_rank))
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"offload.path={setting!r}: only {{rank}} and {{local_rank}} are filled in ({e!r}). "
                    "Fix: escape other braces as {{ and }}."
                ) from None
        if distributed:
            # each rank its own files and lock, under the one configured directory
            if path.parent.exists():
                path.mkdir(exist_ok=True)  # the first rank makes it
            if setting is None:  # ours: whichever rank leaves last removes it (when empty)
                self._created_rank_parent = path
            return path / f"rank_{rank}"
        return path

    def prepare(self, default_root: Path, ssd_bytes: dict[str, int], rank: int = 0, local_rank: int = 0,
                distributed: bool = False, fixes: Sequence[str] = ()) -> PreflightReport:
        """Choose, check and lock the directory for a run that keeps ``ssd_bytes`` there (after removing
        what killed runs left beside it, reported in :attr:`leftovers`). A refusal leaves nothing;
        ``fixes``: the run's own ways to need less disk, said when it does not fit (:func:`preflight`)."""
        path = self._choose(default_root, rank, local_rank, distributed)
        self.leftovers = clear_leftovers(self._neighbours(path, default_root))
        existed = path.exists()
        made: list[Path] = []
        if self.setting is None and not existed:
            # our own default under default_root_dir (which Lightning creates lazily): make the parents;
            # a user-given path with a missing parent is refused by preflight instead (a typo?)
            made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            report = preflight(path, ssd_bytes, fixes=fixes)
            self._lock = OffloadDirLock(report.offload_dir, keep_files=self.config.keep_files, owner=self.owner)
            directory, setting, owner = report.offload_dir, self.setting, self.owner
            # (with the lock: no live run's files; the record found there says whose the files are)
            self._lock.acquire(lambda previous: refuse_kept_files(directory, setting, previous, owner))
        except BaseException:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            for directory in [path] * (not existed) + made:  # what this call created, innermost first
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
        if not existed:
            self._created = report.offload_dir
        self.path = report.offload_dir
        return report

    def _neighbours(self, path: Path, default_root: Path) -> list[Path]:
        """Where a killed run may have left offload files this run should hear about: the directory
        itself, its siblings, and with the default location the other runs' under the same parent
        (Hydra's per-run output folders)."""
        out = [path]
        for parent in {path.parent, *([default_root.parent] if self.setting is None else [])}:
            if not parent.is_dir():
                continue
            for child in parent.iterdir():
                # one stat or two per entry: only directories that hold a lock file, or per-rank ones
                for candidate in (child, child / "greedysnake_offload"):
                    if candidate in out:
                        continue
                    if (candidate / LOCK_NAME).is_file():
                        out.append(candidate)
                    elif candidate.name == "greedysnake_offload" and candidate.is_dir():
                        out += [c for c in candidate.glob("rank_*") if (c / LOCK_NAME).is_file()]
        return out

    def record(self, files: list[Path]) -> None:
        """Name the run's offload files in this directory (of ``files``) in its lock record."""
        if self._lock is not None and self.path is not None:
            self._lock.record([f for f in files if f.parent == self.path])

    def cleanup(self, files: list[Path]) -> None:
        """Remove the run's ``files`` (unless ``keep_files``), release the lock, remove the directories
        this run created when they are empty (never what someone else put there). Idempotent."""
        keep = self.config.keep_files
        if not keep:
            for path in files:
                path.unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.release(files)  # (with keep_files its record stays, naming the files kept)
            self._lock = None
        created, self._created = self._created, None
        if created is not None and not keep:
            with contextlib.suppress(OSError):
                created.rmdir()  # only if empty
            if self._created_rank_parent is not None:
                with contextlib.suppress(OSError):  # only when empty: the last rank out removes it
                    self._created_rank_parent.rmdir()
        self._created_rank_parent = None


class OffloadDirectories:
    """Every offload directory of one process (``offload.path`` may name one per SSD), each prepared,
    locked and cleaned up on its own; a refusal of any leaves none prepared."""

    def __init__(self, config: OffloadConfig, owner: str | None = None) -> None:
        """``owner``: see :class:`OffloadDirectory`."""
        self.dirs = [OffloadDirectory(config, setting, owner) for setting in (config.paths or [None])]
        self.given = config.paths is not None
        """The user named the directories (``offload.path``): each is prepared (checked, locked) for the run
        whatever the placement puts there, and the report says so where it is nothing. The default one
        is only made when something goes to SSD."""

    @property
    def paths(self) -> list[Path]:
        assert all(d.path is not None for d in self.dirs), "not prepared"
        return [d.path for d in self.dirs]  # type: ignore[misc]

    def prepare(self, default_root: Path, ssd_bytes: list[dict[str, int]], rank: int = 0, local_rank: int = 0,
                distributed: bool = False, fixes: Sequence[str] = ()) -> list[PreflightReport]:
        """Prepare each directory for the bytes it will keep (``ssd_bytes``, one dict per directory;
        ``fixes``: see :meth:`OffloadDirectory.prepare`)."""
        reports = []
        try:
            for d, need in zip(self.dirs, ssd_bytes, strict=True):
                reports.append(d.prepare(default_root, need, rank, local_rank, distributed, fixes))
        except BaseException:
            self.cleanup([])
            raise
        if len({r.offload_dir.resolve() for r in reports}) != len(reports):
            self.cleanup([])
            raise ValueError(
                f"offload.path={self.dirs[0].config.path!r} names one directory twice once filled in "
                "(for this rank). Fix: give different directories, one per SSD."
            )
        return reports

    def text(self, reports: list[PreflightReport], empty_note: str, notes: Mapping[str, str] | None = None) -> str:
        """The start-of-run report of the prepared directories: the leftovers removed, then per directory
        what the run keeps there, or ``empty_note`` (why nothing, and how to put state there); ``notes``: the
        kinds placed on SSD that keep no bytes there, and why (:meth:`PreflightReport.text`)."""
        return "\n".join([*(f"greedysnake: {left.text()}" for d in self.dirs for left in d.leftovers),
                          *(r.text(notes) + ("" if r.breakdown else f"\n  {empty_note}") for r in reports)])

    def record(self, files: list[Path]) -> None:
        """Name the run's offload ``files`` (opened in the prepared directories) in each one's lock record:
        greedysnake's mark that they are its own (:class:`~lightning_greedysnake.offload.preflight.LockRecord`)."""
        for d in self.dirs:
            d.record(files)

    def cleanup(self, files: list[Path]) -> None:
        for d in self.dirs:
            d.cleanup([f for f in files if d.path is not None and f.parent == d.path])
