"""The OpenAI Batch API on the gateway: `/v1/files` and `/v1/batches`."""
