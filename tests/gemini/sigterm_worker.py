"""Trains 3 steps in one process with captures every step but disk flushes never, then SIGTERMs itself.

With the argument `native`, the signal comes while the main thread waits in native code that never
returns to the interpreter (a TCPStore wait standing for a collective that hangs): Python's handler
cannot run on the main thread until the wait ends (in 10 minutes)."""

import datetime
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig, enable_resiliency

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = enable_resiliency(model, opt, interval=1, checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6))
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
session.gemini.drain(10)
if sys.argv[1:] == ["native"]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # The signal comes once the main thread waits (a little after, at worst: it is the same either way).
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    print("waiting in native code", flush=True)
    store.wait(["never"], datetime.timedelta(minutes=10))
else:
    print("trained", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
sys.exit(3)  # not reached: SIGTERM terminates the process after the flush
