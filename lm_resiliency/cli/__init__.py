"""The `lm-resiliency` command: parse and render only."""
