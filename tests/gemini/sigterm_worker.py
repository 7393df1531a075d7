"""Trains 3 steps in one process with captures every step but disk flushes never, then SIGTERMs itself.

With the argument `native`, the signal comes while the main thread waits in native code that never
returns to the interpreter (a TCPStore wait standing for a collective that hangs): Python's handler
cannot run on the main thread until the wait ends (in 10 minutes).

With `loader`, the model is larger (a flush of some 64 MB) and a DataLoader's two worker processes
are alive when the signal comes to the whole process group, as torchrun sends it: the workers die
of it while the flush writes, and the loader's SIGCHLD handler raises in the main thread.

With `again`, the model is as large, and SIGTERM keeps coming (every 5 ms) while the handler
flushes: a preemption signals every process of the job, and torchrun passes it on to its workers."""

import datetime
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig, enable_resiliency

loader = sys.argv[1:] == ["loader"]
again = sys.argv[1:] == ["again"]
if loader:
    os.setpgid(0, 0)  # a process group of its own (and its loader workers'), as torchrun starts workers in
width = 4096 if loader or again else 4
model = torch.nn.Linear(width, width)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = enable_resiliency(model, opt, interval=1, checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6))
for _ in range(3):
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
session.gemini.drain(10)


def _end_soon(worker: int) -> None:
    """A loader worker ends of SIGTERM a little after it came (as one busy reading a batch): while
    the main process flushes, not before it began."""

    def end(signum: int, frame: object) -> None:
        threading.Event().wait(0.02)
        os._exit(1)

    signal.signal(signal.SIGTERM, end)


if loader:
    data = torch.utils.data.TensorDataset(torch.arange(64.0))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, worker_init_fn=_end_soon))
    next(batches)  # the workers run
    print("loading", flush=True)
    os.killpg(0, signal.SIGTERM)
    signal.pause()
elif again:

    def storm() -> None:
        for _ in range(2000):  # until the process ends (10 s at most: then the test fails)
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(0.005)

    print("signalled again and again", flush=True)
    threading.Thread(target=storm, daemon=True).start()
    signal.pause()
elif sys.argv[1:] == ["native"]:
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
