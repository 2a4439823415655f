"""The routing table in memory: the router, its policies, circuit breakers and the retry budget."""
