"""`lm-resiliency-quickstart`: one process trains, checkpoints, is killed, is resumed; prints JSON.

CPU by default; `--device cuda` runs the same on a GPU (the asynchronous capture path).

It runs the same small training three times in child processes: uninterrupted; then killed with
SIGKILL after `--kill-at` steps (GEMINI captured every step into shared memory); then restarted as
generation 1, which restores the newest capture and finishes. It prints one JSON object: the step
the restart resumed at, where the state came from, and whether the final parameters are bitwise
equal to the uninterrupted run's. Exit status 0 only when they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _train(steps: int, kill_at: int, out: str, device_name: str) -> int:
    import torch
    from torch import nn

    from lm_resiliency import enable_resiliency

    device = torch.device(device_name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {"batches": 0}
    with enable_resiliency(
        model, opt, interval=1, extra_state_fn=lambda: dict(seen), load_extra_state_fn=seen.update
    ) as session:
        start = session.step_count
        for step in range(start + 1, steps + 1):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(device)
            seen["batches"] += 1
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == kill_at:
                session.gemini.drain(30)
                os.kill(os.getpid(), signal.SIGKILL)
        session.gemini.drain(30)
        torch.save(
            {
                "params": [p.detach().cpu() for p in model.parameters()],
                "start": start,
                "recovered": session.recovered_step,
                "decision": session.last_recovery_decision,
                "batches": seen["batches"],
            },
            out,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lm-resiliency-quickstart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=17)
    ap.add_argument(
        "--device", default="cpu", help="torch device to train on (cuda exercises the GPU capture path)"
    )
    ap.add_argument("--child", nargs=3, metavar=("STEPS", "KILL_AT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _train(int(args.child[0]), int(args.child[1]), args.child[2], args.device)
    if not 0 < args.kill_at < args.steps:
        ap.error("--kill-at must be between 0 and --steps")
    work = Path(tempfile.mkdtemp(prefix="lmr-quickstart-"))
    env = {
        **os.environ,
        "LM_RESILIENCY_SHM_DIR": str(work / "shm"),
        "LM_RESILIENCY_RUN_ID": f"quickstart-{os.getpid()}",
    }

    def child(kill_at: int, out: Path, generation: int, run_id: str) -> int:
        e = {**env, "LM_RESILIENCY_GENERATION": str(generation), "LM_RESILIENCY_RUN_ID": run_id}
        cmd = [
            sys.executable,
            "-m",
            "lm_resiliency.cli.quickstart",
            "--device",
            args.device,
            "--child",
            str(args.steps),
            str(kill_at),
            str(out),
        ]
        return subprocess.run(cmd, env=e, cwd=work, check=False).returncode

    try:
        t0 = time.monotonic()
        base = work / "baseline.pt"
        if child(-1, base, 0, "quickstart-baseline") != 0:
            raise SystemExit("the uninterrupted run failed")
        killed_rc = child(args.kill_at, work / "never.pt", 0, "quickstart-run")
        resumed = work / "resumed.pt"
        t_resume = time.monotonic()
        if child(-1, resumed, 1, "quickstart-run") != 0:
            raise SystemExit("the resumed run failed")
        resume_s = time.monotonic() - t_resume
        import torch

        a, b = torch.load(base, weights_only=False), torch.load(resumed, weights_only=False)
        equal = all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        summary = {
            "device": args.device,
            "steps": args.steps,
            "killed_at_step": args.kill_at,
            "killed_exit_code": killed_rc,
            "resumed_at_step": b["start"],
            "recovery_decision": b["decision"],
            "batches_seen_by_resumed_run": b["batches"],
            "bitwise_equal_to_uninterrupted": equal,
            "resume_s": round(resume_s, 2),
            "total_s": round(time.monotonic() - t0, 2),
        }
        print(json.dumps(summary, indent=2))
        return 0 if equal and b["start"] == args.kill_at else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
