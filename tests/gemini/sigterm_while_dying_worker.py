"""Trains 3 steps in one process (captures every step, disk flushes never), then dies of an
exception; torchrun's SIGTERM (stopping the group) comes while its exit still commits step 3.

The commit of step 3 is held until a SIGTERM flush asks for it (a checksum that takes long); the
SIGTERM is sent once the exit has begun closing GEMINI. Without the flush the process ends on the
signal and the restart never sees step 3."""

import os
import signal
import threading

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = enable_resiliency(model, opt, interval=1, checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6))
gem = session.gemini
closing, flushing = threading.Event(), threading.Event()
commit, close, flush = gem._commit_and_replicate, gem.close, gem.flush_for_restart


def slow_commit(k, header, keeps=-1):  # type: ignore[no-untyped-def]
    if header.step == 3:
        flushing.wait(60)
    commit(k, header, keeps)


def closing_gem() -> None:
    closing.set()
    close()


def flushing_gem(*args, **kwargs):  # type: ignore[no-untyped-def]
    flushing.set()
    return flush(*args, **kwargs)


gem._commit_and_replicate, gem.close, gem.flush_for_restart = slow_commit, closing_gem, flushing_gem


def stop() -> None:
    closing.wait(60)
    print("SIGTERM while closing", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=stop, daemon=True).start()
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
raise RuntimeError("the loop fails after step 3")
