"""Launchers: run a job's command in every worker of a ``torch.distributed`` job.

- :mod:`torch_batch_process.launch.torch_distributed`: ``python -m
  torch_batch_process.launch.torch_distributed [torchrun options] [--] CMD ARGS...`` wraps torch's
  ``torch.distributed.run`` (torchrun) with batch-job defaults, rank-prefixed output, signal
  forwarding and the job's exit code.
- :mod:`torch_batch_process.launch.rank_prefix`: the small wrapper each worker runs to prefix its
  output lines with its rank.

This package imports nothing at import time, so that ``python -m`` can run its modules.
"""
