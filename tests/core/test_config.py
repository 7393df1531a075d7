from __future__ import annotations

import re
from pathlib import Path

import pytest

from lm_resiliency import ConfigError, InMemoryCkptConfig, RecoveryMode, load_policy, parse_policy
from lm_resiliency.cli.main import main as cli_main
from lm_resiliency.config import (
    DurableCheckpointConfig,
    ReplayHarnessConfig,
    RuntimeConfig,
    SCOUTFaultReport,
    read_environment,
)

pytestmark = pytest.mark.timeout(30)

GOOD = """
schema_version = 1
interval = 5
enable_detection = false
recovery_mode = "recovery_verified"

[checkpoint]
replication_chunk_size = 1048576
disk_folder = "/tmp/ckpt"

[replay]
straggler_ratio = 2
hang_stall_threshold_s = 5.0

[runtime]
heartbeat_interval_s = 0.1
heartbeat_timeout_s = 1
"""


def test_good_policy(tmp_path: Path) -> None:
    p = tmp_path / "policy.toml"
    p.write_text(GOOD)
    pol = load_policy(p)
    assert pol.interval == 5 and not pol.enable_detection
    assert pol.checkpoint.replication_chunk_size == 1 << 20 and pol.checkpoint.disk_folder == "/tmp/ckpt"
    assert pol.replay.straggler_ratio == 2.0 and isinstance(pol.replay.straggler_ratio, float)
    assert pol.runtime.heartbeat_timeout_s == 1.0
    with pytest.raises(AttributeError):
        pol.interval = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("interval = 5", "schema_version"),
        ("schema_version = 2", "schema_version"),
        ("schema_version = 1\nintervall = 5", "intervall"),
        ("schema_version = 1\ninterval = '5'", "interval"),
        ("schema_version = 1\ninterval = 0", "interval"),
        ("schema_version = 1\ninterval = true", "interval"),
        ("schema_version = 1\n[checkpoint]\nintervl = 3", "checkpoint.intervl"),
        ("schema_version = 1\n[checkpoint]\npin_memory = 1", "checkpoint.pin_memory"),
        ("schema_version = 1\n[checkpoint]\nreplication_jump = 0", "checkpoint.replication_jump"),
        ("schema_version = 1\n[replay]\nstraggler_ratio = 0.5", "replay.straggler_ratio"),
        ("schema_version = 1\n[replay]\nstraggler_ratio = nan", "replay.straggler_ratio"),
        ("schema_version = 1\n[runtime]\npublish_coalesce_s = nan", "runtime.publish_coalesce_s"),
        ("schema_version = 1\n[runtime]\nheartbeat_timeout_s = 0.1", "runtime.heartbeat_timeout_s"),
        ("schema_version = 1\n[runtime]\nfinish_wait_s = -1", "runtime.finish_wait_s"),
        (
            "schema_version = 1\n[runtime]\nrestart_destination_wait_s = -1",
            "runtime.restart_destination_wait_s",
        ),
        ("schema_version = 1\ncheckpoint = 3", "checkpoint"),
        ("schema_version = 1\nrecovery_mode = 'newest'", "recovery_mode"),
        ("schema_version = 1\nadapter = 'nocolon'", "adapter"),
        ("schema_version = 1\n[surprise]\na = 1", "surprise"),
        ("not toml at all [", "policy"),
    ],
)
def test_bad_policy_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_policy(p)
    assert exc.value.key == key, str(exc.value)
    assert str(exc.value).startswith(key)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_policy("/nonexistent/policy.toml")


def test_dataclasses_validate_directly() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.interval"):
        InMemoryCkptConfig(interval=0)
    with pytest.raises(ConfigError, match=r"checkpoint\.replication_chunk_size: must be at most 4 GiB"):
        InMemoryCkptConfig(replication_chunk_size=10**30)  # (before: every capture failed, packing it)
    with pytest.raises(ConfigError, match="recovery_mode"):
        RecoveryMode.parse("bogus")
    assert RecoveryMode.parse("latest") is RecoveryMode.LATEST
    assert parse_policy({"schema_version": 1}).checkpoint == InMemoryCkptConfig()
    assert RuntimeConfig().heartbeat_timeout_s > RuntimeConfig().heartbeat_interval_s


@pytest.mark.parametrize(
    ("build", "key", "problem"),
    [
        (lambda: ReplayHarnessConfig(hang_stall_threshold_s="5"), "replay.hang_stall_threshold_s", "number"),
        (lambda: InMemoryCkptConfig(replication_jump="2"), "checkpoint.replication_jump", "int"),
        (lambda: InMemoryCkptConfig(interval=2.5), "checkpoint.interval", "int"),
        (lambda: InMemoryCkptConfig(disk_folder=5), "checkpoint.disk_folder", "string"),
        (lambda: InMemoryCkptConfig(verify_integrity="yes"), "checkpoint.verify_integrity", "bool"),
        (lambda: DurableCheckpointConfig(interval=True), "durable.interval", "int"),
        (lambda: RuntimeConfig(heartbeat_timeout_s=None), "runtime.heartbeat_timeout_s", "number"),
        (lambda: ReplayHarnessConfig(straggler_min_ms=float("nan")), "replay.straggler_min_ms", "number"),
    ],
)
def test_dataclasses_built_directly_name_a_field_of_the_wrong_type(build, key: str, problem: str) -> None:  # type: ignore[no-untyped-def]
    """Built in code, not from a policy: a wrong type is a ConfigError naming the field (it was a
    bare TypeError from a range check comparing a str with an int, or accepted)."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: expected (an? )?{problem}"):
        build()


def test_dataclasses_built_directly_take_what_python_takes_for_the_type(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    ckpt = InMemoryCkptConfig(disk_folder=tmp_path, run_id=Path("job"), interval=np.int64(3))  # type: ignore[arg-type]
    assert ckpt.interval == 3 and (ckpt.disk_folder, ckpt.run_id) == (str(tmp_path), "job")
    assert ReplayHarnessConfig(hang_stall_threshold_s=np.float32(2.5), straggler_ratio=2).straggler_ratio == 2


def test_fault_report_dict_drops_unset_keys() -> None:
    d = SCOUTFaultReport(kind="straggler", failed_ranks=(3,), straggler_type="compute").to_dict()
    assert d == {
        "kind": "straggler",
        "failed_ranks": [3],
        "scope": "rank",
        "straggler_type": "compute",
        "reason": "",
    }


def test_environment(tmp_path: Path) -> None:
    mid = tmp_path / "machine-id"
    mid.write_text("abc123\n")
    env = read_environment(
        {
            "LM_RESILIENCY_GENERATION": "3",
            "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
            "TORCHELASTIC_RUN_ID": "r1",
        }
    )
    assert env.generation == 3 and env.node_id() == "abc123" and env.run_id == "r1"
    assert env.control_run_id() == "r1" and env.agent_node_id is None
    assert read_environment({"LM_RESILIENCY_NODE_ID": "n7"}).agent_node_id == "n7"
    # A run id of the checkpoints' own: the torchrun backend's keys stay under its --rdzv-id (before,
    # the workers published their inventories where its agents never looked).
    named = read_environment({"TORCHELASTIC_RUN_ID": "r1", "LM_RESILIENCY_RUN_ID": "mine"})
    assert named.run_id == "mine" and named.control_run_id() == "r1"
    assert read_environment({"LM_RESILIENCY_RUN_ID": "mine"}).control_run_id() == "mine"
    with pytest.raises(ConfigError, match="LM_RESILIENCY_GENERATION"):
        read_environment({"LM_RESILIENCY_GENERATION": "x"})


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["--version"])
    assert exc.value.code == 0 and "lm-resiliency" in capsys.readouterr().out
    p = tmp_path / "policy.toml"
    p.write_text(GOOD)
    assert cli_main(["check-policy", str(p)]) == 0
    assert '"interval": 5' in capsys.readouterr().out
    p.write_text("schema_version = 1\nbogus = 1")
    assert cli_main(["check-policy", str(p)]) == 2
    assert "bogus" in capsys.readouterr().err
