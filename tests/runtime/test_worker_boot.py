"""Zero-import instrumentation (`worker_boot.auto_instrument`), in a process of its own: it patches
torch's optimizer class and adds global module hooks, which must not leak into the test process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys
    from lm_resiliency.worker_boot import auto_instrument
    import torch
    import torch.distributed as dist
    auto_instrument(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    if os.environ.get("PLAIN") == "split":  # its parts called one by one (a backbone, a head)
        ddp, model = None, torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    elif os.environ.get("PLAIN"):  # no data-parallel wrapper: the script reduces (or is a stage)
        ddp, model = None, torch.nn.Linear(8, 8)
    else:
        ddp = model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    params = [model.weight] if os.environ.get("PLAIN") == "part" else model.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    schedule = None
    if os.environ.get("PLAIN") in ("stage", "schedule"):  # a pipeline stage (one stage: world of 1)
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        stage = PipelineStage(model, 0, 1, torch.device("cpu"))
        if os.environ["PLAIN"] == "schedule":  # ... run by a schedule, which every rank steps
            schedule = ScheduleGPipe(stage, 1, loss_fn=lambda out, y: (out - y).square().mean())
    if os.environ.get("COMPILE"):  # the DDP compiled: its forward, hooks included, traced by dynamo
        model = torch.compile(ddp, backend="aot_eager")
    other = None
    if os.environ.get("SECOND") == "ddp":  # a GAN's other network: held with the first
        other = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    elif os.environ.get("SECOND") == "plain":  # a module no DDP holds, trained too: not held
        other = torch.nn.Linear(8, 8)
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    own = None
    if os.environ.get("OWN") == "dict":  # the script's own session, on a module holding the DDP
        from lm_resiliency import enable_resiliency
        own = enable_resiliency(torch.nn.ModuleDict({"net": model}), opt, interval=1)
    elif os.environ.get("OWN") == "chunks":  # ... or on Megatron-style chunks
        from lm_resiliency import enable_resiliency
        own = enable_resiliency([model], opt, interval=1)
    seen = []
    for step in range(2 if schedule is not None else 0):
        opt.zero_grad()
        schedule.step(torch.randn(4, 8), target=torch.zeros(4, 8), losses=[])
        opt.step()
        seen.append(0)
    for step in range(2 if schedule is None else 0):
        x = torch.randn(4, 8)
        loss = (model[1](model[0](x)) if os.environ.get("PLAIN") == "split" else model(x)).square().mean()
        # What the step's backward reduces with: the session's comm hook, from the first step on.
        seen.append(len(ddp._comm_hooks) if ddp is not None else 0)
        if other is not None:
            loss = loss + other(x).square().mean()
            other_opt.zero_grad()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if other is not None:
            other_opt.step()
    from lm_resiliency.api import open_session
    held = getattr(model, "_lm_resiliency_session", None)
    session = own or (held() if held is not None else open_session())
    out = {"hooks": seen, "step_count": session.step_count if session is not None else None}
    if other is not None:
        out["held"] = sorted(type(m).__name__ for m in session._adapter.model.children())
    if session is not None and os.environ.get("PLAIN"):
        out["replicas"] = list(session.scout.group)
    if os.environ.get("COMPILE"):
        from torch._dynamo.utils import counters
        out["graph_breaks"] = dict(counters["graph_break"])
        out["on_wrapper"] = "_lm_resiliency_session" in vars(model)  # (not the DDP's, reached through it)
    print(json.dumps(out))
    if session is not None:
        session.close()
    dist.destroy_process_group()
    """
)


def _run(tmp_path: Path, **env: str) -> tuple[dict, str]:
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 1\ninterval = 1\n")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(policy)],
        cwd=tmp_path,
        env={
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "PATH": "/usr/bin:/bin",
            "LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_every_ddp_model_made_before_the_first_forward_is_held(tmp_path: Path) -> None:
    """A GAN's generator and discriminator, each a DDP with its optimizer: both held, as one
    ModuleDict in the order they were made, and both optimizers as one chain. Before, the model
    called first alone, and a restart started the other afresh (it was only said)."""
    result, stderr = _run(tmp_path, SECOND="ddp")
    assert result["step_count"] == 2 and result["held"] == ["DistributedDataParallel"] * 2, result
    assert "2 DDP models" in stderr and "other DDP model" not in stderr, stderr


def test_a_script_with_more_models_than_the_session_holds_is_told(tmp_path: Path) -> None:
    """A module no DDP holds, trained by an optimizer of its own beside the DDP: a restart would
    restore the DDP and start the other afresh: said, not silent."""
    result, stderr = _run(tmp_path, SECOND="plain")
    assert result["step_count"] == 2
    assert "0 other DDP model(s) and 1 other optimizer(s)" in stderr, stderr


def test_the_session_enabled_at_the_first_forward_takes_part_in_that_step(tmp_path: Path) -> None:
    """The session is enabled inside the first forward, after torch chose that forward's hooks.
    Its own (the step's start, DDP's canonical comm hook) must still run for that forward: without
    them DDP's first backward reduced in its own bucket layout, and a job of 4 ranks resumed by the
    torchrun backend differed in the last bits from the uninterrupted run."""
    result, stderr = _run(tmp_path)
    assert result == {"hooks": [1, 1], "step_count": 2}, (result, stderr)
    assert "other DDP model" not in stderr, stderr  # the session holds all there is


@pytest.mark.parametrize("own", ["dict", "chunks"])
def test_a_script_that_enabled_its_own_session_on_another_object_is_left_alone(
    tmp_path: Path, own: str
) -> None:
    """The script's own session holds the DDP inside a ModuleDict (a GAN's pair) or a list of
    chunks: the DDP's first forward found it unmarked and enabled a second session, which failed
    the worker ("this process already has an open session") in every generation."""
    result, stderr = _run(tmp_path, OWN=own)
    assert result == {"hooks": [1, 1], "step_count": 2}, (result, stderr)
    assert "instrumented automatically" not in stderr, stderr


def test_a_compiled_ddp_is_instrumented_by_its_wrapper_not_traced(tmp_path: Path) -> None:
    """`torch.compile(DDP(model))`: the DDP's forward runs inside the compiled region, where dynamo
    traced the first-forward hook and enable_resiliency itself (graph breaks at every call it
    cannot trace: `time.perf_counter`, sockets, locks), and the session's hooks landed on the DDP,
    traced at every step (an outsider's 4-rank job ran 2x slower, its campaign 3x). The session
    is now enabled on the compiled wrapper, eagerly: none of its calls is traced (DDP's own graph
    breaks stay), and it takes part in the first step as before."""
    result, stderr = _run(tmp_path, COMPILE="1")
    breaks = result.pop("graph_breaks")
    assert result == {"hooks": [1, 1], "step_count": 2, "on_wrapper": True}, (result, stderr[-3000:])
    ours = (
        "perf_counter",
        "monotonic",
        "gethostname",
        "allocate_lock",
        "get_ident",
        "mkdir",
        "lm_resiliency",
    )
    assert not [b for b in breaks if any(w in b for w in ours)], breaks
    assert "instrumented automatically" in stderr and "other DDP model" not in stderr, stderr


@pytest.mark.parametrize("kind", ["yes", "part", "split", "stage", "schedule"])
def test_a_module_no_data_parallel_wrapper_holds_is_instrumented_or_said_not_to_be(
    tmp_path: Path, kind: str
) -> None:
    """A plain module whose trainable parameters the optimizers step (the script all-reduces its
    gradients itself) is instrumented at its first forward (before, never, and silently: restarts
    resumed the data at the planned step with fresh weights). One the optimizers step only in
    part, and a pipeline stage (whose first forward waits for the stage before it, while enabling
    is collective), are not, nor is a part of it called on its own (a backbone, then a head: the
    session would hold the backbone alone), and the first optimizer step says so. A stage run by a
    pipeline schedule is instrumented at the schedule's first step(), before its forwards."""
    result, stderr = _run(tmp_path, PLAIN=kind)
    if kind in ("yes", "schedule"):
        assert result["step_count"] == 2 and result["replicas"] == [0], (result, stderr)
        said = "a pipeline stage" if kind == "schedule" else "a module no data-parallel wrapper holds"
        assert f"{said}: no replicas known" in stderr, stderr
        assert "not instrumented" not in stderr, stderr
    else:
        assert result["step_count"] is None, (result, stderr)
        assert stderr.count("lm_resiliency: not instrumented") == 1, stderr
        assert ("pipeline-parallel job" in stderr) == (kind == "stage"), stderr
