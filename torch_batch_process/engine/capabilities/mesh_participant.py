"""``upload_path()`` files of a replica's members (``mesh=``, DESIGN §18) as a commit participant: only the writer's
files are outputs, and a member's file is never lost silently.

Every member of a replica runs the same processor code, so a member that is not the writer often writes the same file
as the writer (``torch.save`` of the outputs every member holds). Its ``upload_path()`` yields a scratch folder whose
files are removed when the block ends; the names of the files it wrote there (relative to the folder) travel in its
next vote. The writer's votes carry the names of the files it wrote through its own ``upload_path()``. Rank 0 checks
each commit's votes: a member's name the writer of its replica also wrote in that commit is the same output (the
replica's members run the same batches in lockstep, so they commit together); **a name the writer did not write
refuses the commit** with :class:`~torch_batch_process.errors.MeshOutputError` naming the rank, the file and the fix,
and the job fails (resumably) rather than dropping the file. A list of names per member and commit is the whole cost.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch_batch_process.engine.commit.participants import Participant, Payload
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.work import Part
from torch_batch_process.errors import MeshOutputError
from torch_batch_process.mesh_shape import MeshLayout, MeshPosition

__all__ = ["MemberFiles", "MemberFilesParticipant", "UploadedNames"]


@dataclass(frozen=True)
class UploadedNames(Payload):
    """The files a rank wrote with ``upload_path()`` since its previous vote (paths relative to the folder)."""

    key = "mesh_files"
    names: tuple[str, ...]


class MemberFiles:
    """This rank's ``context.upload_path``: the stager's on the replica's writer, a scratch folder elsewhere; both
    remember the names of the files written (see the module docstring).

    Args:
        position: this rank's place in the mesh.
        stager_upload_path: the output stager's ``upload_path`` (the writer's files become outputs).
    """

    def __init__(
        self, position: MeshPosition, stager_upload_path: Callable[[], contextlib.AbstractContextManager[Path]]
    ) -> None:
        self._position = position
        self._stager_upload_path = stager_upload_path
        self.names: list[str] = []
        """Files written since this rank's previous vote."""

    @contextlib.contextmanager
    def upload_path(self) -> Iterator[Path]:
        """A folder for output files (see :meth:`TorchBatchProcessorContext.upload_path`); a block that raises keeps
        no name (its files are discarded on every rank)."""
        if self._position.is_writer:
            with self._stager_upload_path() as folder:
                yield folder
                self.names += _files_in(folder)
            return
        folder = Path(tempfile.mkdtemp(prefix=f"tbp-member-rank{self._position.rank}-"))
        try:
            yield folder
            self.names += _files_in(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _files_in(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if not path.is_dir())


class MemberFilesParticipant(Participant):
    """The members' ``upload_path()`` names in the commits (see the module docstring).

    Args:
        files: this rank's upload names.
        layout: the job's mesh (rank 0 finds each member's writer).
    """

    def __init__(self, files: MemberFiles, layout: MeshLayout) -> None:
        self._files = files
        self._layout = layout

    def contribute(self, part: Part, closing: bool) -> UploadedNames | None:
        names, self._files.names = self._files.names, []
        return UploadedNames(tuple(names)) if names else None

    def check(self, votes: Sequence[Vote]) -> None:
        """Raises :class:`~torch_batch_process.errors.MeshOutputError` for a member's file its writer did not write
        in the same commit."""
        written: dict[int, set[str]] = {}
        for vote in votes:
            payload = vote.payloads.get(UploadedNames)
            if payload is not None and self._layout.position(vote.rank).is_writer:
                written[vote.rank] = set(payload.names)
        for vote in votes:
            payload = vote.payloads.get(UploadedNames)
            position = self._layout.position(vote.rank)
            if payload is None or position.is_writer:
                continue
            missing = sorted(set(payload.names) - written.get(position.writer_rank, set()))
            if missing:
                shown = ", ".join(repr(name) for name in missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise MeshOutputError(
                    f"rank {vote.rank} wrote {shown} with context.upload_path(), which the writer of its replica "
                    f"(rank {position.writer_rank}) did not write in the same commit: only the writer's files are "
                    "outputs with mesh=, and this file would be lost; write it on the writer "
                    "(if context.is_writer: ...)"
                )
