"""A slow node named by link probes, on real network namespaces: three synthetic hosts, each in its
own namespace on a bridge, one rank of a gloo DDP job in each. Node c's link is rate-limited with a
token bucket on both directions; SCOUT must name node c as a communication straggler endpoint, and
the same job without the limit must report nothing. Needs root (skipped otherwise)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
NODES = ("a", "b", "c")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """A bridge in this namespace and one namespace per node, 10.<x>.<y>.<i>/24."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"lmrb{tag}"
        self.ns = {n: f"lmr{tag}{n}" for n in NODES}
        self.veth = {n: f"lmv{tag}{n}" for n in NODES}
        net = int(tag[:2], 16)
        self.prefix = f"10.{200 + net % 50}.{int(tag[2:4], 16)}"
        self.master = f"{self.prefix}.254"
        self.addr = {n: f"{self.prefix}.{i + 1}" for i, n in enumerate(NODES)}

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.master}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for n in NODES:
            _ip("netns", "add", self.ns[n])
            _ip("link", "add", self.veth[n], "type", "veth", "peer", "name", "eth0", "netns", self.ns[n])
            _ip("link", "set", self.veth[n], "master", self.bridge, "up")
            _ip("-n", self.ns[n], "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
            _ip("-n", self.ns[n], "link", "set", "eth0", "up")
            _ip("-n", self.ns[n], "link", "set", "lo", "up")

    def throttle(self, node: str, rate: str = "16mbit") -> None:
        """A token bucket on both directions of the node's link."""
        tbf = ["root", "tbf", "rate", rate, "burst", "16kb", "latency", "500ms"]
        subprocess.run(
            ["tc", "-n", self.ns[node], "qdisc", "add", "dev", "eth0", *tbf], check=True, timeout=30
        )
        subprocess.run(["tc", "qdisc", "add", "dev", self.veth[node], *tbf], check=True, timeout=30)

    def down(self) -> None:
        for n in NODES:
            subprocess.run(["ip", "netns", "del", self.ns[n]], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", self.veth[n]], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts()
    try:
        h.up()
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as exc:
        h.down()
        pytest.skip(f"network namespaces unavailable here: {exc}")
    try:
        yield h
    finally:
        h.down()


def _run(processes, hosts: Hosts, tmp: Path) -> list[dict]:  # type: ignore[no-untyped-def]
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
    procs = []
    for r, n in enumerate(NODES):
        mid = tmp / f"machine-id-{n}"
        mid.write_text(f"node-{n}\n")
        env = {
            "RANK": str(r),
            "WORLD_SIZE": str(len(NODES)),
            "MASTER_ADDR": hosts.master,
            "STORE_PORT": str(store.port),
            "RESULT_DIR": str(tmp),
            "DURATION_S": "6",
            "GLOO_SOCKET_IFNAME": "eth0",
            "LM_RESILIENCY_BIND_HOST": hosts.addr[n],
            "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
        }
        procs.append(
            processes.start(
                ["tests/integration/workers/link_worker.py"],
                env,
                tmp / f"rank{r}.log",
                prefix=("ip", "netns", "exec", hosts.ns[n]),
            )
        )
    deadline = time.monotonic() + 180
    for r, p in enumerate(procs):
        assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, (tmp / f"rank{r}.log").read_text()[
            -3000:
        ]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(len(NODES))]


def test_a_rate_limited_node_is_named_as_a_slow_communication_endpoint(
    processes, hosts: Hosts, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    hosts.throttle("c")
    for res in _run(processes, hosts, tmp_path):
        links = [f for f in res["faults"] if f.get("straggler_type") == "communication"]
        assert [
            (
                f["kind"],
                f["failed_ranks"],
                f["scope"],
                f["endpoint_kind"],
                f["endpoint_id"],
                f["endpoint_rank"],
            )
            for f in links
        ] == [("straggler", [2], "node", "node", "node-c", 2)], res["faults"]
        assert links[0]["reason"] == "slow_node_link" and links[0]["confirmations"] == 3


def test_the_same_job_on_healthy_links_reports_nothing(processes, hosts: Hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for res in _run(processes, hosts, tmp_path):
        assert res["faults"] == [], res["faults"]
