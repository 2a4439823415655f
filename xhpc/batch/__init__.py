"""Batch inference: the OpenAI Batch API's files (``lines``), a batch's spec (``spec``), and
one shard of it as one task of the batch's Slurm job array (``task``)."""
