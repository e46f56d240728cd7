"""The commit: one commit path for 1 and N processes and both schedules (DESIGN §7).

Each rank votes (its batches, state file, metrics lines, failure, stop request); rank 0 merges the votes into
commit records and writes them (record keeping, group commit); each rank then publishes its committed stages
into ``outputs/``. Votes travel by one of two transports: gathered (``schedule="static"``: every rank at the
same step) or queued (``schedule="dynamic"``: each rank on its own). What each capability stores with a commit
(record rows, a table's files, memory limits, failing examples, batch-time histograms, the reducers' summaries) is a
participant of the commit (:mod:`~torch_batch_process.engine.commit.participants`): its typed payloads travel in the
votes, rank 0 merges them into the records, and what every rank must learn is shared back by each transport.
Opening the job (rank 0 reads, checks and repairs what is stored) is the commit path's start.

Promise: exactly-once outputs: a file appears under ``outputs/`` only once the durable record that covers it
was written, together with the batches it came from, and a crash anywhere is repaired at the next start. A
failure anywhere (a hook, a background record write, a publication) travels to every rank with the next vote,
so every rank raises, the failing rank its own exception and the others its traceback.
"""
