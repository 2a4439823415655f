"""Commands that make and change deployments: serve, scale, adapters, batches."""
