"""The Batch API's jobs: the desk, its inputs and models."""
