"""The engine: the loop and the components it wires together (plan, scheduler, committer, agreement)."""
