"""SCOUT's pure decisions: the same evidence gives the same verdict on every rank."""
