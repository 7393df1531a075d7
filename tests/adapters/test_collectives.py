"""The step's own torch.distributed collectives: wrapped while a session is attached, tracked in-step
only, restored after (one real gloo process group of one rank)."""

from __future__ import annotations

import _thread
import threading

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.adapters import collectives

pytestmark = pytest.mark.timeout(60)


class Tracker:
    thread: int | None = None  # (any thread's collectives are its own)

    def __init__(self) -> None:
        self.stepping = False
        self.seen: list[tuple[str, bool]] = []
        self.open = 0
        self.waited: list[float] = []  # blocking collectives between steps: timed, chained, not waited in

    def in_step(self) -> bool:
        return self.stepping

    def enter_collective(self, signature: str, waits: bool) -> None:
        self.seen.append((signature, waits))
        self.open += waits

    def wait_collective(self) -> None:
        self.seen.append(("wait", True))
        self.open += 1

    def exit_collective(self) -> None:
        self.open -= 1

    def waited_between_steps(self, seconds: float) -> None:
        self.waited.append(seconds)


@pytest.fixture
def group():  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_in_step_collectives_are_tracked_and_torch_is_restored_after(group) -> None:  # type: ignore[no-untyped-def]
    torch_all_reduce = dist.all_reduce
    a, b = Tracker(), Tracker()
    collectives.install(a)
    collectives.install(b)  # a second session: the newest one tracks
    try:
        assert dist.all_reduce is not torch_all_reduce
        assert collectives.original("all_reduce") is torch_all_reduce
        x = torch.ones(6)
        dist.all_reduce(x)  # between steps: chained, never waited in, timed (waiting is not input)
        dist.all_reduce(x, async_op=True).wait()  # (an async one waits in wait(): not timed)
        dist.all_reduce(x, group=dist.new_group([0]))  # a subgroup's, between steps: only timed
        between = [("all_reduce:6:torch.float32:1", False)] * 2
        assert b.seen == between and len(b.waited) == 2 and b.waited[0] >= 0 and a.waited == []
        assert b.open == 0
        b.seen.clear()
        b.stepping = True
        dist.all_reduce(x)
        dist.broadcast(torch.ones(3, dtype=torch.int64), 0)
        dist.barrier()
        dist.all_reduce(x, async_op=True).wait()
        dist.all_to_all_single(torch.empty(2), torch.ones(2))
        assert b.seen == [
            ("all_reduce:6:torch.float32:1", True),
            ("broadcast:3:torch.int64:1", True),
            ("barrier:1", True),
            ("all_reduce:6:torch.float32:1", False),  # async: entered, but the wait is not ours to see
            ("all_to_all_single:1", True),  # uneven splits are legal: op and group size only
        ]
        assert b.open == 0 and a.seen == []
        assert x.tolist() == [1.0] * 6  # the real collective ran
    finally:
        collectives.uninstall(b)
        assert dist.all_reduce is not torch_all_reduce  # a is still attached
        collectives.uninstall(a)
    assert dist.all_reduce is torch_all_reduce


def test_an_error_in_the_collective_still_closes_it(group) -> None:  # type: ignore[no-untyped-def]
    t = Tracker()
    t.stepping = True
    collectives.install(t)
    try:
        with pytest.raises(RuntimeError, match="invalid root rank"):
            dist.broadcast(torch.ones(2), src=5)  # no rank 5 in a group of one
        assert t.open == 0 and len(t.seen) == 1
    finally:
        collectives.uninstall(t)


def test_a_step_opens_at_a_training_forward_and_closes_at_the_optimizer_step() -> None:
    from lm_resiliency.adapters.pytorch import PyTorchAdapter

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adapter = PyTorchAdapter(model, opt)
    adapter.attach(lambda times: None)
    try:
        with torch.no_grad():
            model(torch.ones(2, 3))  # an evaluation between steps
        assert not adapter.in_step()
        model(torch.ones(2, 3)).sum().backward()
        assert adapter.in_step()
        opt.step()
        assert not adapter.in_step()
    finally:
        adapter.detach()


def test_a_compiled_graph_calls_torch_collective_without_a_graph_break(group) -> None:  # type: ignore[no-untyped-def]
    t = Tracker()
    t.stepping = True
    collectives.install(t)
    try:

        def f(x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            dist.all_reduce(y)
            return y + 1

        compiled = torch.compile(f, fullgraph=True, backend="eager")  # fullgraph: a break would raise
        assert compiled(torch.ones(3)).tolist() == [3.0] * 3
        assert t.seen == []  # traced as torch's own collective
        assert f(torch.ones(3)).tolist() == [3.0] * 3
        assert [s for s, _ in t.seen] == ["all_reduce:3:torch.float32:1"]  # eager: tracked
    finally:
        collectives.uninstall(t)


def test_a_collective_where_none_may_run_raises_at_once_and_only_on_that_thread(group) -> None:  # type: ignore[no-untyped-def]
    """An audit replays one rank's work alone: a collective inside would wait for peers that never
    join, so it raises instead (the replay fails; the module is not audited), on that thread only."""
    import threading

    tracker = Tracker()
    collectives.install(tracker)
    try:
        x = torch.ones(2)
        with collectives.forbidden("an audit replay"):
            with pytest.raises(collectives.CollectiveForbidden, match=r"all_reduce inside an audit replay"):
                dist.all_reduce(x)
            done = threading.Event()

            def elsewhere() -> None:
                dist.all_reduce(x)  # another thread is not inside the replay
                done.set()

            t = threading.Thread(target=elsewhere)
            t.start()
            t.join(timeout=30)
            assert done.is_set()
        dist.all_reduce(x)  # allowed again after the block
        # Only the calls that ran are chained (between steps: never waited in).
        assert tracker.seen == [("all_reduce:2:torch.float32:1", False)] * 2 and torch.equal(x, torch.ones(2))
    finally:
        collectives.uninstall(tracker)


def test_functional_collectives_are_entered_when_called_and_waited_in_when_used(group) -> None:  # type: ignore[no-untyped-def]
    """Tensor parallelism's collectives: the call enqueues (an entered collective), the first use of
    the result blocks in `wait_tensor` (waiting in it); one that calls another counts once."""
    import torch.distributed._functional_collectives as funcol

    torch_wait = funcol.wait_tensor
    t = Tracker()
    collectives.install(t)
    try:
        x = torch.arange(6.0)
        assert funcol.all_reduce(x, "sum", dist.group.WORLD).tolist() == x.tolist()  # between steps
        assert t.seen == []
        t.stepping = True
        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
        assert t.seen == [("all_reduce:6:torch.float32:1", False)]  # enqueued, not waited for yet
        assert (y + 1).tolist() == (x + 1).tolist()  # first use: the wait
        g = funcol.all_gather_single_autograd(torch.ones(2, 3), 0, dist.group.WORLD)  # calls another
        assert g.sum().item() == 6.0
        assert t.seen == [
            ("all_reduce:6:torch.float32:1", False),
            ("wait", True),
            ("all_gather_single_autograd:6:torch.float32:1", False),
            ("wait", True),
        ]
        assert t.open == 0
        with collectives.forbidden("a replay"), pytest.raises(collectives.CollectiveForbidden):
            funcol.all_reduce(x, "sum", dist.group.WORLD)
    finally:
        collectives.uninstall(t)
    assert funcol.wait_tensor is torch_wait and not hasattr(funcol.all_reduce, "_lm_resiliency_wraps")


def test_a_pipeline_schedules_point_to_point_wait_is_waited_in(group) -> None:  # type: ignore[no-untyped-def]
    """torch.distributed.pipelining waits for its neighbour stages' activations and gradients in
    `_wait_batch_p2p`: waited in as a collective (a stage whose neighbour hangs is seen waiting, not
    idle), never entered (the stages of two replica groups issue other transfers), and before the
    stage's first forward (waiting for its input) timed as no input time. Before, not seen: a hang
    of rank 3 (stage 1) named rank 2 too (stage 0, waiting for its gradients)."""
    from torch.distributed.pipelining import schedules

    torch_wait = schedules._wait_batch_p2p
    t = Tracker()
    collectives.install(t)
    try:
        assert schedules._wait_batch_p2p is not torch_wait
        done: list[int] = []

        class Work:  # (a transfer needs a peer: one process has none)
            def wait(self) -> None:
                done.append(1)

        schedules._wait_batch_p2p([Work(), Work()])  # before the first forward: the stage's input
        assert done == [1, 1]  # torch's wait ran
        assert t.seen == [("wait", True)] and t.open == 0 and len(t.waited) == 1
        t.stepping = True
        schedules._wait_batch_p2p([])
        assert t.seen == [("wait", True)] * 2 and t.open == 0 and len(t.waited) == 1
    finally:
        collectives.uninstall(t)
    assert schedules._wait_batch_p2p is torch_wait


def test_a_blocking_send_or_receive_is_waited_in(group) -> None:  # type: ignore[no-untyped-def]
    """A pipeline written by hand waits for its neighbours in `dist.send`/`dist.recv`: waited in as a
    collective, never entered, inside a step or before it (timed as no input time), closed when the
    call fails. Before, not seen: a stage waiting for a hung neighbour looked idle, and a job that
    knows no peers (judged as a whole) would have named it beside the hung one."""
    torch_send, torch_recv = dist.send, dist.recv
    t = Tracker()
    collectives.install(t)
    try:
        assert dist.send is not torch_send and dist.recv is not torch_recv
        assert collectives.original("recv") is torch_recv
        for fn in (dist.send, dist.recv):
            with pytest.raises((RuntimeError, ValueError)):  # (a transfer needs a peer: one process has none)
                fn(torch.ones(2), 0)
        assert t.seen == [("wait", True)] * 2 and t.open == 0 and len(t.waited) == 2
        t.stepping = True
        with pytest.raises((RuntimeError, ValueError)):
            dist.recv(torch.ones(2), 0)
        assert t.seen == [("wait", True)] * 3 and t.open == 0 and len(t.waited) == 2
    finally:
        collectives.uninstall(t)
    assert dist.send is torch_send and dist.recv is torch_recv


def test_a_thread_the_script_started_beside_the_training_thread_is_not_tracked(group) -> None:  # type: ignore[no-untyped-def]
    """A metrics thread of the script's own all-reducing over a group of its own: its calls are no
    part of the step (neither chained nor waited in, inside a step or between steps); the training
    thread's are, and so are those of a thread torch started in C++ (the autograd engine's device
    threads run backward hooks that issue the step's collectives; Python sees them as dummy
    threads, as it does one started by _thread). Before, the metrics thread's were chained in
    whatever order the threads ran, and their returns counted as the training thread's progress."""
    t = Tracker()
    t.thread = threading.get_ident()
    collectives.install(t)
    try:
        x = torch.ones(4)

        def from_thread(start: object) -> None:
            done = threading.Event()

            def run() -> None:
                try:
                    dist.all_reduce(x)
                    dist.barrier()
                finally:
                    done.set()

            if start == "python":
                threading.Thread(target=run).start()
            else:
                _thread.start_new_thread(run, ())
            assert done.wait(30)

        for stepping in (False, True):
            t.stepping = stepping
            from_thread("python")
            assert t.seen == [] and t.waited == [] and t.open == 0
        from_thread("c++")
        dist.all_reduce(x)
        assert t.seen == [
            ("all_reduce:4:torch.float32:1", True),
            ("barrier:1", True),
            ("all_reduce:4:torch.float32:1", True),
        ]
        assert t.open == 0 and x.tolist() == [1.0] * 4
    finally:
        collectives.uninstall(t)
