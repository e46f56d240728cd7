"""Outputs: ``upload_path()`` files and record outputs, staged for the committer to publish."""
