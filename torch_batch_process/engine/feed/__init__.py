"""The feed: this rank's batches, loaded and run (DESIGN §7).

The loader with the user's options and the library's batch sampler, the device prefetcher, the DataLoader's
workers, the batch runner (``process_batch`` under inference mode and autocast), a streaming source's
dataset and order, and what guards a batch: ``on_error="skip"`` (failing examples split off and recorded),
``on_oom="split"`` (a batch that runs out of the device's memory runs in parts that fit, and what fits is learned
so that later batches are cut before they run: ``oom``, ``fitting``, ``device_memory``) and ``batch_timeout`` (the
watchdog).

Promise: only this rank's batches are loaded, each with its global ``batch_idx``; a batch counts as done only
when ``process_batch`` returned; a failure (a load, a batch, a timeout) is recorded for this rank, never
swallowed, and with ``on_error="skip"`` only the examples that fail alone are skipped; a batch run in parts gives
the outputs of the batch run whole, each written once.
"""
