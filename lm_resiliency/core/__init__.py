"""The pure decision core.

Rules for everything under this package: values in, values out. No zmq, torch, asyncio, threads,
clocks or environment reads; time arrives as a `now` argument. A test imports this package in a fresh
interpreter and checks `sys.modules` to keep it that way.
"""
