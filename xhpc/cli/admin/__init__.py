"""Commands that look after the site: API keys and usage, the model catalog, the weights
cache, the broker's state."""
