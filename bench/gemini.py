"""GEMINI benchmark: ours vs the stock way, measured side by side in one run.

Prints progress, then one JSON object on the last line:
  capture_block_ratio_vs_torch_save  training-thread blocking time of one capture into shared memory
                                     / torch.save (+fsync) of the same model+optimizer state (goal <= 0.05)
  restore_speedup_vs_torch_load      torch.load from disk (the file evicted from the page cache)
                                     + load_state_dict / restore from local shared memory, checksums
                                     verified (goal >= 13); `..._warm_cache`: the file cached;
                                     `..._fresh_optimizer`: both into a new model and an optimizer
                                     with no state yet, as a restarted process has (file cached)
  replica_ratio_vs_raw_zmq           replication of a committed capture to a peer process (chunk
                                     checksums verified, authenticated, acknowledged, written into the
                                     peer's shared memory) / raw pyzmq (goal >= 0.8);
                                     `replica_ratio_including_commit` adds the capture's own checksums
  healthy_throughput_ratio           4-rank DDP steps/s capturing every step / not capturing,
                                     alternating blocks in the same processes (goal >= 0.99); with
                                     rank 0's CPU per step, all threads and the training thread's own
  capture_block_ratio_vs_torch_save_many_tensors
                                     the same blocking ratio for a state of 2400 small tensors (300
                                     Linear layers and their AdamW state): a capture's per-tensor work
  plus the state sizes and step time used.

With `--device cuda` (a GPU machine) it measures the GPU path instead: capture blocking time of a
CUDA model's state (asynchronous device-to-host copies on a side stream into registered shared memory)
vs torch.save, restore vs torch.load, and `healthy_throughput_ratio` of one GPU training a model with a
capture every step vs none, alternating blocks in one process.

Usage: python bench/gemini.py [--state-mib 256] [--reps 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench import child_pythonpath  # noqa: E402


def spawn_all(mode: str, world: int, env: dict[str, str], tmp: Path) -> dict[str, object]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for r in range(world):
        mid = tmp / f"machine-id-{mode}-{r}"
        mid.write_text(f"bench-node-{r}\n")
        full = {
            **os.environ,
            "PYTHONPATH": child_pythonpath(),
            "OMP_NUM_THREADS": "1",
            "MODE": mode,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "STORE_PORT": str(store.port),
            "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
            "LM_RESILIENCY_SHM_DIR": str(tmp / "shm"),
            **env,
        }
        procs.append(
            subprocess.Popen([sys.executable, str(ROOT / "bench" / "_gemini_worker.py")], env=full, cwd=tmp)
        )
    try:
        for p in procs:
            if p.wait(900) != 0:
                raise RuntimeError(f"{mode} worker failed")
        return json.loads(store.get("bench/result"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_save(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Seconds to torch.save the model's and optimizer's state to `path` and fsync it."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def in_process(state_mib: int, reps: int, tmp: Path, device: torch.device, shm: Path) -> dict[str, object]:
    from lm_resiliency import InMemoryCkptConfig, RuntimeConfig, enable_resiliency

    os.environ["LM_RESILIENCY_SHM_DIR"] = str(shm / "shm")
    width = 1024
    rows = (state_mib << 20) // 3 // (4 * width)  # params + 2 AdamW moments ~= state_mib
    torch.manual_seed(0)
    model = nn.Linear(width, rows, bias=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()
    _sync(device)
    session = enable_resiliency(
        model,
        opt,
        interval=10**9,
        # (the durable tier's folder in the bench's own, not the folder the bench runs from)
        checkpoint=InMemoryCkptConfig(disk_flush_interval=10**9, disk_folder=str(shm / "checkpoints")),
        runtime=RuntimeConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0),
    )
    gem = session.gemini
    save_path = tmp / "torch_save.pt"
    blocks, saves, loads, warm_loads, restores = [], [], [], [], []
    fresh_loads, fresh_restores = [], []

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        """A restarted process's model and optimizer (allocated outside the timings)."""
        m = nn.Linear(width, rows, bias=False).to(device)
        _sync(device)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def torch_load(m: nn.Module, o: torch.optim.Optimizer) -> float:
        t0 = time.perf_counter()
        sd = torch.load(save_path, weights_only=True)
        m.load_state_dict(sd["model"])
        o.load_state_dict(sd["optimizer"])
        _sync(device)
        return time.perf_counter() - t0

    def restore(m: nn.Module, o: torch.optim.Optimizer, k: int, step: int) -> float:
        """GEMINI's restore of slot `k` into `m` and `o`."""
        gem.model, gem.optimizer = m, o
        try:
            t0 = time.perf_counter()
            gem._restore_from(gem._own[k], step)
            _sync(device)
            return time.perf_counter() - t0
        finally:
            gem.model, gem.optimizer = model, opt

    for i in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        assert gem.capture(i + 1)
        blocks.append(time.perf_counter() - t0)
        gem.drain(120)
        _sync(device)
        saves.append(_timed_save(save_path, model, opt))
        # "From disk": evict the file from the page cache first (this file only, nothing global).
        fd = os.open(save_path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        k = next(k for k, s in gem._own_step.items() if s == i + 1)
        loads.append(torch_load(model, opt))
        warm_loads.append(torch_load(model, opt))  # the baseline's best case: the page cache warm
        restores.append(restore(model, opt, k, i + 1))
        fresh_loads.append(torch_load(*fresh()))
        fresh_restores.append(restore(*fresh(), k, i + 1))
        print(
            f"rep {i}: capture blocks {blocks[-1] * 1e3:.1f} ms, torch.save {saves[-1] * 1e3:.0f} ms, "
            f"torch.load {loads[-1] * 1e3:.0f} ms, restore {restores[-1] * 1e3:.1f} ms; into a fresh "
            f"optimizer: torch.load {fresh_loads[-1] * 1e3:.0f} ms, "
            f"restore {fresh_restores[-1] * 1e3:.1f} ms",
            flush=True,
        )
    state_bytes = gem.stats.bytes_per_capture
    many = many_tensors(gem, reps, tmp, device)
    gem.model, gem.optimizer = model, opt
    session.close()
    return {
        **many,
        "state_bytes": state_bytes,
        "capture_block_s": statistics.median(blocks),
        "torch_save_s": statistics.median(saves),
        "capture_block_ratio_vs_torch_save": statistics.median(blocks) / statistics.median(saves),
        "restore_s": statistics.median(restores),
        "torch_load_s": statistics.median(loads),
        "restore_speedup_vs_torch_load": statistics.median(loads) / statistics.median(restores),
        "torch_load_warm_cache_s": statistics.median(warm_loads),
        # posix_fadvise(DONTNEED) is a hint: near 1.0 here means the file stayed cached and the
        # "from disk" figure is really a page-cache figure.
        "torch_load_cold_over_warm": statistics.median(loads) / statistics.median(warm_loads),
        "restore_speedup_vs_torch_load_warm_cache": statistics.median(warm_loads)
        / statistics.median(restores),
        "restore_fresh_optimizer_s": statistics.median(fresh_restores),
        "torch_load_fresh_optimizer_s": statistics.median(fresh_loads),
        "restore_speedup_vs_torch_load_fresh_optimizer": statistics.median(fresh_loads)
        / statistics.median(fresh_restores),
    }


def many_tensors(
    gem: Any, reps: int, tmp: Path, device: torch.device, layers: int = 300
) -> dict[str, object]:
    """A capture's blocking time for a state of many small tensors (a model of `layers` Linear
    layers and their AdamW moments: 2 + 6 tensors a layer), where the per-tensor work of a capture
    shows rather than the copy's bandwidth, vs torch.save of the same state."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64, device=device)).sum().backward()
    opt.step()
    gem.model, gem.optimizer = model, opt
    save_path = tmp / "torch_save_many.pt"
    blocks, saves = [], []
    for i in range(2 * reps + 2):  # the first two (one into each slot) lay the slots out
        _sync(device)
        t0 = time.perf_counter()
        assert gem.capture(10**6 + i)
        dt = time.perf_counter() - t0
        gem.drain(120)
        if i >= 2:
            blocks.append(dt)
        _sync(device)
        saves.append(_timed_save(save_path, model, opt))
    save_path.unlink()
    tensors = len(model.state_dict()) + sum(len(v) for v in opt.state.values())
    print(
        f"{tensors} tensors: capture blocks {statistics.median(blocks) * 1e3:.2f} ms, "
        f"torch.save {statistics.median(saves) * 1e3:.1f} ms",
        flush=True,
    )
    return {
        "many_tensors": tensors,
        "many_tensors_state_bytes": gem.stats.bytes_per_capture,
        "capture_block_s_many_tensors": statistics.median(blocks),
        "capture_block_ratio_vs_torch_save_many_tensors": statistics.median(blocks)
        / statistics.median(saves),
    }


def gpu_throughput(
    blocks: int, block_steps: int, width: int, layers: int, tmp: Path, device: torch.device
) -> dict[str, object]:
    """One GPU, one process: steps/s capturing every step vs not, alternating blocks."""
    from lm_resiliency import InMemoryCkptConfig, RuntimeConfig, enable_resiliency

    os.environ["LM_RESILIENCY_SHM_DIR"] = str(tmp / "shm-gpu")
    torch.manual_seed(0)
    blocks_ = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    model = nn.Sequential(*blocks_).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8192 if device.type == "cuda" else 64, width, device=device)
    session = enable_resiliency(
        model,
        opt,
        interval=1,
        enable_detection=False,
        checkpoint=InMemoryCkptConfig(disk_flush_interval=10**9, disk_folder=str(tmp / "checkpoints")),
        runtime=RuntimeConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0),
    )
    gem = session.gemini

    waited: dict[str, list[float]] = {"on": [], "off": []}

    def run(n: int, mode: str = "") -> float:
        """Steps/s to the end of the training stream's work: the block's last capture copies on
        the side stream while a running job's next step computes (the fence waits for it before
        that step's optimizer, on the device), so a block does not wait for it. Also recorded with
        the wait for that last copy (`waited`), as a block that ended the job would pay it."""
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            loss = model(batch).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        t1 = time.perf_counter()
        _sync(device)
        if mode:
            waited[mode].append(n / (time.perf_counter() - t0))
        return n / (t1 - t0)

    gem.interval = 10**9  # warm-up without captures
    run(5)
    gem.interval = 1
    run(5)  # the first captures allocate and register the slots
    gem.drain(120)
    on, on10, off, block_ms = [], [], [], []
    for _ in range(blocks):
        gem.interval = 10**9
        off.append(run(block_steps, "off"))
        gem.drain(120)
        gem.interval = 1
        on.append(run(block_steps, "on"))
        block_ms.append(gem.stats.capture_block_s_last * 1e3)
        gem.drain(120)
        gem.interval = 10
        on10.append(run(block_steps))
        gem.drain(120)
        print(
            f"gpu block: capture every step {on[-1]:.2f} steps/s, every 10 {on10[-1]:.2f}, "
            f"none {off[-1]:.2f} steps/s",
            flush=True,
        )
    stats = gem.stats
    state_bytes = stats.bytes_per_capture
    registered = bool(getattr(gem._copier, "_registered", None))
    session.close()
    # The copy engine's raw rate into page-locked memory, for the same bytes: the floor of a capture.
    flat = torch.empty(state_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rates = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        _sync(device)
        rates.append(state_bytes / (time.perf_counter() - t0) / 1e9)
    return {
        "gpu_state_bytes": state_bytes,
        "gpu_step_s": 1 / statistics.median(off),
        "gpu_steps_per_s_capture": statistics.median(on),
        "gpu_steps_per_s_plain": statistics.median(off),
        "healthy_throughput_ratio": statistics.median(on) / statistics.median(off),
        "healthy_throughput_ratio_interval_10": statistics.median(on10) / statistics.median(off),
        "healthy_throughput_ratio_last_copy_waited": statistics.median(waited["on"])
        / statistics.median(waited["off"]),
        "gpu_capture_block_ms": statistics.median(block_ms),
        "gpu_raw_d2h_pinned_gbps": statistics.median(rates),
        "gpu_slots_page_locked": registered,
        "gpu_captures_skipped_busy": stats.skipped_busy,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--replica-mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument(
        "--rows",
        type=int,
        default=64,
        help="rows of each rank's batch in the DDP figures: with the width, the compute a step does for "
        "each byte a capture copies (64: ~400 flops a parameter a step; an LLM step does 6 a token over "
        "thousands of tokens; "
        "2048: ~12k, an LLM-like step)",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gpu-width", type=int, default=4096)
    ap.add_argument("--gpu-layers", type=int, default=4)
    args = ap.parse_args()
    device = torch.device(args.device)
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(
        prefix="lmr-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    ) as d:
        tmp = Path(d)
        disk = Path(tempfile.mkdtemp(prefix="lmr-bench-disk-"))  # torch.save goes to a real disk
        try:
            out.update(in_process(args.state_mib, args.reps, disk, device, tmp))
        finally:
            import shutil

            shutil.rmtree(disk, ignore_errors=True)
        print(f"in-process: {out}", flush=True)
        if device.type == "cuda":
            out["device"] = "cuda"
            out.update(
                gpu_throughput(args.blocks, args.block_steps, args.gpu_width, args.gpu_layers, tmp, device)
            )
            print(json.dumps(out))
            return
        out.update(spawn_all("replica", 2, {"REPS": str(args.reps), "MIB": str(args.replica_mib)}, tmp))
        print(f"replica: ratio {out['replica_ratio_vs_raw_zmq']:.2f}", flush=True)
        out.update(
            spawn_all(
                "ddp",
                4,
                {
                    "BLOCKS": str(args.blocks),
                    "BLOCK_STEPS": str(args.block_steps),
                    "WIDTH": str(args.width),
                    "ROWS": str(args.rows),
                },
                tmp,
            )
        )
    out["goals"] = {
        "capture_block_ratio_vs_torch_save": "<= 0.05",
        "restore_speedup_vs_torch_load": ">= 13",
        "replica_ratio_vs_raw_zmq": ">= 0.8",
        "healthy_throughput_ratio": ">= 0.99",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
