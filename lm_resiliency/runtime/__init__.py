"""The shell: one event loop thread per process, ZeroMQ transport, discovery and membership."""
