"""Keyed outputs and incremental runs (DESIGN §21): each example's key and content hash, the planner that finds
which examples of a grown or changed dataset a rerun processes (in memory bounded by one partition of keys), the
selection it hands to the plan, and the read side's shadowing of superseded rows.

Design, API and what is still to be wired into the engine: ``notes/46-incremental.md``.
"""
