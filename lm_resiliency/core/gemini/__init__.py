"""GEMINI's pure decisions: where replicas go, which step a recovery restores and from where."""
