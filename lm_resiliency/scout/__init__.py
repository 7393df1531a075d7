"""SCOUT: evidence on the training thread, verdicts on the runtime thread, reports to the caller."""
