"""A session with GEMINI on forks a child (as a DataLoader forks its workers), which takes SIGTERM
(as a loader terminates a worker that does not stop). Prints what the child saw: its wakeup fd
(which the parent's SIGTERM watch must not read for its own) and its exit code."""

import multiprocessing
import os
import signal

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency


def child(conn) -> None:  # type: ignore[no-untyped-def]
    conn.send(signal.set_wakeup_fd(-1))
    conn.close()
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()


if __name__ == "__main__":
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = enable_resiliency(
        model, opt, interval=1, checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6)
    )
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ctx = multiprocessing.get_context("fork")
    parent, kid = ctx.Pipe()
    p = ctx.Process(target=child, args=(kid,))
    p.start()
    print("child wakeup fd", parent.recv(), flush=True)
    p.join(60)
    print("child exit", p.exitcode, flush=True)
    session.close()
    print("parent done", flush=True)
