"""The schedule: which batch a rank runs next, and when the ranks commit, stop or fail (DESIGN §3, §8).

``static`` deals the batches left round-robin in lockstep (a stream's in contiguous blocks); ``dynamic`` lets
a free rank take the next batch from a shared counter. Around them: the agreement of the static schedule's
ranks (at step boundaries every ~50 ms and at every commit), the heartbeats that find a lost rank of a dynamic
job, and the signal watcher that turns SIGTERM or SIGINT into a request to stop.

Promise: every batch of the plan not committed yet is dealt to exactly one rank per attempt; every rank takes
the same decision (commit, stop, fail) at the same point, so no collective waits for a rank that left, and a
stop or failure anywhere reaches every rank within one agreement period and a step (static: ~50 ms, see
:mod:`~torch_batch_process.engine.schedule.agreement`) or a batch (dynamic).
"""
