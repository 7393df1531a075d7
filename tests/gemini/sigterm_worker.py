"""Trains 3 steps in one process with captures every step but disk flushes never, then SIGTERMs itself."""

import os
import signal
import sys

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = enable_resiliency(model, opt, interval=1, checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6))
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
session.gemini.drain(10)
print("trained", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
signal.pause()
sys.exit(3)  # not reached: SIGTERM terminates the process after the flush
