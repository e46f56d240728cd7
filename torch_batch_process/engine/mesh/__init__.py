"""The job's device mesh on the running processes (DESIGN §18): the torch ``DeviceMesh`` handed to the user as
``context.mesh``, the library's own group per replica, and the batch sent from a replica's first member to the
others.

The numbers (the spec, each rank's replica, member and writer) are :mod:`torch_batch_process.mesh_shape`'s; this
sub-package creates process groups, so every rank of the job calls it at the same point of a call (creating a group
is a collective over the default group). It sits beside ``plan`` and ``schedule``, below ``feed`` and ``commit``,
which use it.
"""
