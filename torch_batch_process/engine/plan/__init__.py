"""The plan: which global batches a job has and which dataset examples each one holds (DESIGN §7).

Plans: contiguous batches (DESIGN §3), length-bucketed batches (§9), row ranges inside the shards of a
streaming source (§12), and a retry's batches of failed examples (§11). Every plan answers
``batch_indices(g)``, counts the examples of a set of batches, and is cut to ``max_batches``.

Promise: a plan is deterministic from the job's fingerprint (the plan's own fingerprint is part of it), so every
rank and every resume, with any world size, computes the same plan, and global batch ``g`` names the same
examples forever.
"""
