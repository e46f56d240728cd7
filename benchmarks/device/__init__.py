"""Running the GPU checks on a lent machine that reaches no package index (see ``check.sh``)."""
