"""One module per contender; each runs one workload once and writes its timing report.

- ``hand_loop``: the baseline a user writes by hand (DataLoader + loop + ``torch.save`` per batch).
- ``tbp``: ``torch_batch_process`` with ``upload_path()`` per batch.
- ``pl_trainer``: PyTorch Lightning ``Trainer.predict`` with a ``BasePredictionWriter``.
- ``hf_accelerate``: Hugging Face accelerate ``prepare`` + loop + ``gather_for_metrics``.
- ``ray_data``: Ray Data ``map_batches`` over an actor pool, then ``write_numpy``.
- ``sentence_transformers``: ``SentenceTransformer.encode`` (its multi-process pool with 2 processes); MiniLM only.
"""
