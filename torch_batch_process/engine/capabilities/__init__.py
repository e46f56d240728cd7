"""The capabilities of a call as commit participants (DESIGN §20).

Each module here is one capability's side of the commit: the typed payload its votes carry, how rank 0 merges the
votes into the records, what it stores under the record's JSON names, and how it restores itself from the latest
record (:class:`~torch_batch_process.engine.commit.participants.Participant`). A capability's other side lives with
its component (the record writer in ``outputs/``, the fitter and the failing examples in ``engine/feed/``); this
package sits between them and the loop, so that ``engine/feed`` and ``engine/commit`` never import each other.
The loop makes the participants of a call from the capabilities it enables
(:class:`~torch_batch_process.engine.loop.JobRun`).
"""
