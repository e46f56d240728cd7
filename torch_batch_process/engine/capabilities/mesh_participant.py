"""``upload_path()`` files of a replica's members (``mesh=``, DESIGN §18) as a commit participant: only the writer's
files are outputs, and a member's file is never lost silently.

Every member of a replica runs the same processor code, so a member that is not the writer often writes the same file
as the writer (``torch.save`` of the outputs every member holds). Its ``upload_path()`` yields a scratch folder whose
files are removed when the block ends; the names of the files it wrote there (relative to the folder) travel in its
next vote, with the vote's number. The writer's votes carry the names of the files it wrote through its own
``upload_path()``. Rank 0 checks the votes: a member's name the writer of its replica also wrote in its vote of the
same number is the same output (the replica's members run the same batches in step, so their votes of the same
number hold the same batches); **a name the writer did not write refuses the commit** with
:class:`~torch_batch_process.errors.MeshOutputError` naming the rank, the file and the fix, and the job fails
(resumably) rather than dropping the file. A list of names per member and commit is the whole cost.
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
    vote: int = 0
    """The number of this rank's vote in this attempt (a replica's members vote in step: the same number, the same
    batches)."""


_KEPT_VOTES = 64
"""How many of a writer's latest votes rank 0 keeps the names of (a member's vote comes at most a few records after
its writer's vote of the same number)."""


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
        self.is_writer = position.is_writer
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
        self._votes = 0
        self._written: dict[int, dict[int, set[str]]] = {}
        """Rank 0: the names each writer wrote, by the number of its vote."""
        self._pending: list[tuple[int, UploadedNames]] = []
        """Rank 0: members' names whose writer's vote of that number has not come yet."""

    def contribute(self, part: Part, closing: bool) -> UploadedNames | None:
        names, self._files.names = self._files.names, []
        vote, self._votes = self._votes, self._votes + 1
        if names or self._files.is_writer:  # a writer's vote number tells rank 0 which of its votes it has seen
            return UploadedNames(tuple(names), vote)
        return None

    def check(self, votes: Sequence[Vote]) -> None:
        """Raises :class:`~torch_batch_process.errors.MeshOutputError` for a member's file its writer did not write
        in the vote of the same number (the same batches). Under the dynamic schedule a member's vote and its
        writer's may reach rank 0 in different records: a member's names wait until its writer's vote of that number
        came."""
        for vote in votes:
            payload = vote.payloads.get(UploadedNames)
            if payload is None:
                continue
            if self._layout.position(vote.rank).is_writer:
                seen = self._written.setdefault(vote.rank, {})
                seen[payload.vote] = set(payload.names)
                for old in [n for n in seen if n < payload.vote - _KEPT_VOTES]:
                    del seen[old]
            else:
                self._pending.append((vote.rank, payload))
        waiting = []
        while self._pending:
            rank, payload = self._pending.pop()
            writer = self._layout.position(rank).writer_rank
            written = self._written.get(writer, {})
            if max(written, default=-1) < payload.vote:
                waiting.append((rank, payload))  # its writer's vote of that number has not come yet
                continue
            missing = sorted(set(payload.names) - written.get(payload.vote, set()))
            if missing:
                self._pending += waiting
                shown = ", ".join(repr(name) for name in missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise MeshOutputError(
                    f"rank {rank} wrote {shown} with context.upload_path(), which the writer of its replica "
                    f"(rank {writer}) did not write in the same commit: only the writer's files are "
                    "outputs with mesh=, and this file would be lost; write it on the writer "
                    "(if context.is_writer: ...)"
                )
        self._pending = waiting
