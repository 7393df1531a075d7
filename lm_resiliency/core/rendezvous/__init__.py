"""Pure rendezvous logic for the torchrun backend: state, transitions, election, liveness."""
