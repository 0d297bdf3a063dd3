"""The test kit: loopback servers, a puller fleet, mounted file systems and greedy drafters, for tests and demos."""
