"""GEMINI: frequent in-memory checkpoints in shared memory, peer replicas, tiered recovery."""
