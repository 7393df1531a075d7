"""Framework adapters: read a job's topology and attach step-boundary hooks, without touching its loop."""
