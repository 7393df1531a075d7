"""SCOUT benchmark on a real 4-rank gloo DDP job (processes on this host).

Prints progress, then one JSON object on the last line:
  healthy_throughput_ratio  steps/s with fingerprints + gossip every step / with detection paused,
                            alternating blocks in the same processes (goal >= 0.99)
  healthy_throughput_ratio_vs_plain_ddp  the same against a plain DDP copy of the model in the same
                            processes, which lm-resiliency never touched (our comm hook included)
  overhead_ms_per_step      the per-step cost of detection, in milliseconds (a job with steps of
                            T ms loses about overhead/T of its throughput)
  ..._coalesced[_2_ranks]   ratio and overhead with RuntimeConfig.publish_coalesce_s = --coalesce
                            (what the training thread submits within that long of the last send
                            leaves with the next batch: no wakeup of the runtime every short step)
  ..._2_ranks               the same three with 2 ranks (one per core of this 2-core machine, as a
                            GPU node has cores to spare per rank; 4 ranks share 2 cores above).
                            Two replicas also keep replay records on every checked step (host copies
                            of the parameters, gradients and optimizer state, ~0.7 ms a step here),
                            which groups of three or more do not need
  detect_steps_straggler    steps from the first slow step to the compute-straggler verdict
  detect_s_hang             seconds from a rank's stall to the hang verdict (threshold 2 s)
  detect_steps_sdc          steps from the bit flip to the SDC verdict
  detect_s_<kind>           the same in seconds, from the reports' detection_latency_s (slowest rank)
  audited_throughput_ratio  as healthy_throughput_ratio, with a peer re-executing every rank's
                            micro-batch every --audit-interval steps (audits pause with detection)
  detect_steps_output_sdc   steps from a corrupted forward output (averaged away by the all-reduce,
                            invisible to fingerprints) to the verdict of an audit (every step here)
  false_positives           verdicts over a clean run with timing jitter (--clean-steps)

The fault scenarios use tests/integration/workers/scout_worker.py, the same job the tests run.

With `--device cuda` (a GPU machine) it measures what detection costs the GPU instead, on one device
training a model, alternating blocks in one process: SCOUT's own fingerprint calls (folds on the
device, copied to the host behind an event, resolved a step later as the runtime does) of the
gradients after reduction and of the parameters and optimizer state after the step
(`gpu_healthy_throughput_ratio`: every step / none), and, instead of those, the check at rest of a
rank no replica holds: its parameters and optimizer state fingerprinted as the step left them and
again before the next (`gpu_rest_check_ratio`).

Usage: python bench/scout.py [--clean-steps 500] [--device cpu|cuda] [--throughput-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "integration" / "workers" / "scout_worker.py"
sys.path.insert(0, str(ROOT))
import torch.distributed as dist  # noqa: E402

from bench import child_pythonpath  # noqa: E402


def run(
    scenario: str,
    steps: int,
    culprit: int = -1,
    at: int = -1,
    extra: dict[str, str] | None = None,
    wait_all: bool = True,
    world: int = 4,
) -> tuple[list[dict], float]:
    tmp = Path(tempfile.mkdtemp(prefix=f"lmr-scout-{scenario}-"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": child_pythonpath(),
            "OMP_NUM_THREADS": "1",
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "STORE_PORT": str(store.port),
            "RESULT_DIR": str(tmp),
            "STEPS": str(steps),
            "SCENARIO": scenario,
            "CULPRIT": str(culprit),
            "AT_STEP": str(at),
            "REPORT_DIR": str(tmp / "reports"),
            # The captures of its checkpointing scenarios, in a folder removed with the rest (not the
            # host's /dev/shm/lm_resiliency/default, where they waited an hour for a restart).
            "LM_RESILIENCY_SHM_DIR": str(tmp / "shm"),
            **(extra or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=env,
                cwd=tmp,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    expect = [r for r in range(world) if wait_all or r != culprit]
    try:
        deadline = time.monotonic() + 600
        while not all((tmp / f"rank{r}.json").exists() for r in expect):
            if time.monotonic() > deadline or (wait_all and any(p.poll() not in (None, 0) for p in procs)):
                raise RuntimeError(f"scenario {scenario} failed; see {tmp}")
            time.sleep(0.05)
        stalled = float(store.get("test/stalled_at")) if scenario == "hang" else 0.0
        results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in expect]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)  # (kept when the scenario failed: the error names it)
    return results, stalled


def medians(res: list[dict]) -> tuple[float, float, float]:
    """Rank 0's median steps/s with detection on, paused, and of the plain DDP copy."""
    rates = res[0]["rates"]
    return tuple(statistics.median(rates[mode]) for mode in ("on", "off", "plain"))  # type: ignore[return-value]


def latency_s(res: list[dict], kind: str) -> float | None:
    """The slowest rank's detection latency (seconds, from its report) for verdicts of `kind`."""
    # A report leaves the latency out when its rank had not ended the verdict's step (not known).
    found = [f.get("detection_latency_s") for r in res for f in r["faults"] if f["kind"] == kind]
    return max(found) if found and None not in found else None


def gpu_fingerprint_cost(
    blocks: int, block_steps: int, width: int, layers: int, device_name: str = "cuda", bf16: bool = False
) -> dict[str, object]:
    """One GPU: steps/s with SCOUT's per-step fingerprints of a replicated rank ("on"), or the check
    at rest of a rank no replica holds ("rest"), vs none ("off")."""
    import torch
    from torch import nn

    from lm_resiliency.scout.fingerprint import fingerprint_async
    from lm_resiliency.scout.replay import optimizer_tensors

    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]).to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8192 if device.type == "cuda" else 64, width, device=device)
    params = list(model.parameters())

    def run(n: int, mode: str) -> float:
        pending: list = []  # resolved a step later, as the runtime thread does
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            if mode == "rest" and pending:  # the next step's pre-hook: the state as it is now
                pending.append(fingerprint_async(params + list(optimizer_tensors(opt))))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(batch).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for fp in pending:
                fp.result()
            pending = []
            if mode == "on":
                pending.append(fingerprint_async(p.grad for p in params))
            opt.step()
            if mode == "on":
                pending.append(fingerprint_async(params))
                pending.append(fingerprint_async(optimizer_tensors(opt)))
            if mode == "rest":
                pending.append(fingerprint_async(params + list(optimizer_tensors(opt))))
        for fp in pending:
            fp.result()
        sync()
        return n / (time.perf_counter() - t0)

    for mode in ("off", "on", "rest"):
        run(3, mode)  # warm-up: kernels, pinned buffers
    rates: dict[str, list[float]] = {"off": [], "on": [], "rest": []}
    for _ in range(blocks):
        for mode in rates:
            rates[mode].append(run(block_steps, mode))
        print("gpu block: " + ", ".join(f"{m} {r[-1]:.2f} steps/s" for m, r in rates.items()), flush=True)
    off, on, rest = (statistics.median(rates[m]) for m in ("off", "on", "rest"))
    tensors = len(params) + len(list(optimizer_tensors(opt)))
    state = sum(t.numel() * t.element_size() for t in params + list(optimizer_tensors(opt)))
    return {
        "device": device.type,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        "gpu_healthy_throughput_ratio": on / off,
        "gpu_rest_check_ratio": rest / off,
        "gpu_step_ms": 1000.0 / off,
        "gpu_fingerprint_ms_per_step": 1000.0 / on - 1000.0 / off,
        "gpu_rest_check_ms_per_step": 1000.0 / rest - 1000.0 / off,
        "gpu_state_bytes": state,
        "gpu_tensors": tensors,
        "gpu_autocast_bf16": bf16,
        "goals": {"gpu_healthy_throughput_ratio": ">= 0.99"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clean-steps", type=int, default=500)
    ap.add_argument("--block-steps", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument(
        "--rows",
        type=int,
        default=32,
        help="rows of each rank's batch in the throughput figures (32: ~200 flops a parameter a step; "
        "2048: ~12k, an LLM-like step)",
    )
    ap.add_argument("--audit-interval", type=int, default=10)
    ap.add_argument("--coalesce", type=float, default=0.02, help="publish_coalesce_s of the _coalesced runs")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gpu-width", type=int, default=4096)
    ap.add_argument("--gpu-layers", type=int, default=4)
    ap.add_argument("--gpu-bf16", action="store_true", help="forward under bf16 autocast (shorter steps)")
    ap.add_argument(
        "--throughput-only",
        action="store_true",
        help="the 4- and 2-rank throughput figures, no fault scenarios",
    )
    args = ap.parse_args()
    if args.device == "cuda":
        cost = gpu_fingerprint_cost(
            args.blocks, args.block_steps, args.gpu_width, args.gpu_layers, bf16=args.gpu_bf16
        )
        print(json.dumps(cost))
        return
    out: dict[str, object] = {}
    rows = {"ROWS": str(args.rows)}
    res, _ = run("throughput", args.block_steps, extra={"BLOCKS": str(args.blocks), **rows})
    on, off, plain = medians(res)
    out.update(
        healthy_throughput_ratio=on / off,
        healthy_throughput_ratio_vs_plain_ddp=on / plain,
        steps_per_s_detection_on=on,
        steps_per_s_detection_paused=off,
        steps_per_s_plain_ddp=plain,
        step_ms_plain_ddp=1000.0 / plain,
        overhead_ms_per_step=1000.0 / on - 1000.0 / off,
        rows_per_step=args.rows,
    )
    print(f"throughput: {out}", flush=True)
    # The same with one rank per core: no rank's runtime threads compete with another's training.
    res, _ = run("throughput", args.block_steps, extra={"BLOCKS": str(args.blocks), **rows}, world=2)
    on2, off2, plain2 = medians(res)
    out.update(
        healthy_throughput_ratio_2_ranks=on2 / off2,
        healthy_throughput_ratio_vs_plain_ddp_2_ranks=on2 / plain2,
        overhead_ms_per_step_2_ranks=1000.0 / on2 - 1000.0 / off2,
    )
    print(f"2 ranks: on/paused {on2 / off2:.3f}, on/plain {on2 / plain2:.3f}", flush=True)
    if args.throughput_only:
        out["cpu_count"] = os.cpu_count()
        print(json.dumps(out))
        return
    # RuntimeConfig.publish_coalesce_s: steps of a few ms need not wake the runtime one by one.
    for world in (4, 2):
        res, _ = run(
            "throughput",
            args.block_steps,
            extra={"BLOCKS": str(args.blocks), "COALESCE": str(args.coalesce)},
            world=world,
        )
        onc, offc, _ = medians(res)
        suffix = "" if world == 4 else "_2_ranks"
        out[f"healthy_throughput_ratio_coalesced{suffix}"] = onc / offc
        out[f"overhead_ms_per_step_coalesced{suffix}"] = 1000.0 / onc - 1000.0 / offc
    out["publish_coalesce_s"] = args.coalesce
    print(f"coalesced: {out}", flush=True)
    res, _ = run(
        "throughput",
        args.block_steps,
        extra={"BLOCKS": str(args.blocks), "AUDIT": str(args.audit_interval)},
    )
    on, off, _ = medians(res)
    out.update(audited_throughput_ratio=on / off, audit_interval=args.audit_interval)
    print(f"audited throughput: {on / off:.3f}", flush=True)
    res, _ = run("compute", 15, culprit=1)
    seen = [r["first_seen_step"].get("straggler:[1]") for r in res]
    out["detect_steps_straggler"] = max(s for s in seen if s is not None) if all(seen) else None
    out["detect_s_straggler"] = latency_s(res, "straggler")
    res, stalled = run("hang", 60, culprit=0, at=8, wait_all=False)
    out["detect_s_hang"] = max(r["hang_seen_at"] for r in res) - stalled
    out["hang_stall_threshold_s"] = 2.0
    res, _ = run("sdc", 12, culprit=2, at=6)
    seen = [r["first_seen_step"].get("sdc:[2]") for r in res]
    out["detect_steps_sdc"] = (
        (max(s for s in seen if s is not None) - 6) if all(s is not None for s in seen) else None
    )
    out["detect_s_sdc"] = latency_s(res, "sdc")
    res, _ = run("output", 10, culprit=2, at=6, extra={"AUDIT": "1"})
    seen = [r["first_seen_step"].get("sdc:[2]") for r in res]
    out["detect_steps_output_sdc"] = (
        (max(s for s in seen if s is not None) - 6) if all(s is not None for s in seen) else None
    )
    out["detect_s_output_sdc"] = latency_s(res, "sdc")
    res, _ = run("clean", args.clean_steps)
    out["false_positives"] = sum(len(r["faults"]) for r in res)
    out["clean_steps"] = args.clean_steps
    out["goals"] = {
        "healthy_throughput_ratio": ">= 0.99",
        "detect_steps_straggler": "<= 3 (+ gossip)",
        "detect_s_hang": "<= 2 x threshold",
        "false_positives": "== 0",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
