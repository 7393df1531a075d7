"""Fault campaigns, schema_version 1 (INTERFACE.md §3): strict parsing and the replayable schedule.

Pure: no torch, no clock, no environment. A campaign names incidents; each incident has a trigger
(training iterations, a probability), a lifetime (how long a fault stays active once it fired), a
retrigger rule (what happens when recovery replays the iteration) and its faults (a canonical type,
FAILURES.md, and a target). `Schedule` says which incidents fire at an iteration given what fired
before, so a campaign replays identically: probability draws come from the campaign seed, the
incident id and the iteration only.

Every error is a `CampaignError` naming the JSON path of what is wrong
(`incidents[0].trigger.range.every: expected a JSON int >= 1, got 1.5`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_resiliency.core.taxonomy import CANONICAL_TYPES
from lm_resiliency.errors import ConfigError

__all__ = [
    "CLOCK_ORIGINS",
    "CLOCK_TYPES",
    "RETRIGGERS",
    "SURFACES",
    "TENSOR_MAGNITUDES",
    "TENSOR_OPERATIONS",
    "TENSOR_SCOPES",
    "UNTIL",
    "Campaign",
    "CampaignError",
    "Fault",
    "Incident",
    "Lifetime",
    "Occurrence",
    "Schedule",
    "Target",
    "Trigger",
    "draw",
    "load_campaign",
    "load_campaigns",
    "parse_campaign",
]

SCHEMA_VERSION = 1
SURFACES = (
    "input",
    "output",
    "weight",
    "bias",
    "gradient",
    "optimizer_state",
    "rng_state",
    "sampler_state",
    "data",
    "checkpoint",
    "compute",
    "collective",
    "process",
    "resource",
    "config",
)
TENSOR_OPERATIONS = ("single_bitflip", "multi_bitflip", "set_value", "scale", "noise", "sign_flip")
TENSOR_SCOPES = ("single", "row", "1%", "10%", "100%")
TENSOR_MAGNITUDES = ("catastrophic", "large", "medium", "subtle", "near_invisible")
RETRIGGERS = ("once", "every_attempt", "max_occurrences")
UNTIL = ("recovery", "replacement", "campaign_end")
CLOCK_TYPES = ("training_iteration",)
CLOCK_ORIGINS = ("training_run",)


class CampaignError(ConfigError):
    """A campaign is malformed; `key` is the JSON path of what is wrong, `source` the file."""

    def __init__(self, key: str, problem: str, source: str = "") -> None:
        super().__init__(f"{source}: {key}" if source else key, problem)
        self.path = key
        self.source = source


@dataclass(frozen=True)
class Target:
    surface: str
    rank: int | None = None
    model_part: int | None = None
    component: str | None = None
    index: int | None = None
    module_path: str | None = None
    operation: str | None = None
    resource: str | None = None
    path: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    fault_id: str
    type: str
    target: Target
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Trigger:
    at: tuple[int, ...] | None = None  # explicit iterations
    start: int = 0  # or a range: start..end inclusive, every `every`
    end: int | None = None
    every: int = 1
    probability: float = 1.0

    def matches(self, iteration: int) -> bool:
        """Whether the iteration is one of the trigger's (before the probability draw)."""
        if self.at is not None:
            return iteration in self.at
        if iteration < self.start or (self.end is not None and iteration > self.end):
            return False
        return (iteration - self.start) % self.every == 0


@dataclass(frozen=True)
class Lifetime:
    matching_calls: int | None = None
    iterations: int | None = None
    until: str | None = None

    def active(self, fired_at: int, iteration: int, calls: int) -> bool:
        """Whether a fault that fired at `fired_at` is still active at `iteration` after `calls`
        matching calls. An `until` lifetime is active for the rest of the process that fired it;
        the injector re-arms `replacement` in later generations on the same node and
        `campaign_end` in every later generation. Other lifetimes end with the process: a recovery
        ends them."""
        if self.matching_calls is not None:
            return calls < self.matching_calls
        if self.iterations is not None:
            return fired_at <= iteration < fired_at + self.iterations
        return True


@dataclass(frozen=True)
class Incident:
    incident_id: str
    trigger: Trigger
    lifetime: Lifetime
    retrigger: str
    max_occurrences: int | None
    faults: tuple[Fault, ...]

    def faults_for(self, rank: int) -> tuple[Fault, ...]:
        """The faults this rank injects: those whose target names it (a target without a rank is
        rank 0's to inject)."""
        return tuple(f for f in self.faults if (f.target.rank if f.target.rank is not None else 0) == rank)


@dataclass(frozen=True)
class Campaign:
    name: str
    seed: int
    incidents: tuple[Incident, ...]
    clock_type: str = "training_iteration"
    clock_origin: str = "training_run"
    metadata: Mapping[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def incident(self, incident_id: str) -> Incident:
        for inc in self.incidents:
            if inc.incident_id == incident_id:
                return inc
        raise KeyError(incident_id)

    def digest(self) -> str:
        """A short digest of the campaign's canonical JSON (every node must run the same one)."""
        return hashlib.sha256(json.dumps(self.source_dict, sort_keys=True).encode()).hexdigest()[:16]

    source_dict: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


# --- parsing ------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, problem: str) -> CampaignError:
        return CampaignError(key, problem, self.source)

    def obj(
        self, value: Any, key: str, allowed: Iterable[str], required: Iterable[str] = ()
    ) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key or "campaign", f"expected a JSON object, got {_kind(value)}")
        allowed = tuple(allowed)
        for k in value:
            if k not in allowed:
                raise self.fail(_join(key, k), f"unknown key (known: {', '.join(sorted(allowed))})")
        for k in required:
            if k not in value:
                raise self.fail(_join(key, k), "missing")
        return value

    def int_(self, value: Any, key: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected a JSON int, got {_kind(value)} {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def opt_int(self, d: Mapping[str, Any], k: str, key: str, minimum: int | None = None) -> int | None:
        return None if k not in d else self.int_(d[k], _join(key, k), minimum)

    def str_(self, value: Any, key: str, choices: Iterable[str] | None = None) -> str:
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {_kind(value)} {value!r}")
        if choices is not None:
            choices = tuple(choices)
            if value not in choices:
                raise self.fail(key, f"expected one of {list(choices)}, got {value!r}")
        elif not value:
            raise self.fail(key, "must not be empty")
        return value

    def opt_str(self, d: Mapping[str, Any], k: str, key: str) -> str | None:
        return None if k not in d else self.str_(d[k], _join(key, k))

    def meta(self, d: Mapping[str, Any], k: str, key: str) -> dict[str, Any]:
        value = d.get(k, {})
        if not isinstance(value, dict):
            raise self.fail(_join(key, k), f"expected a JSON object, got {_kind(value)}")
        return value


_JSON_KINDS = (
    (type(None), "null"),
    (bool, "bool"),
    (int, "int"),
    (float, "float"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)  # bool before int: a bool is an int in Python


def _kind(value: Any) -> str:
    return next((name for tp, name in _JSON_KINDS if isinstance(value, tp)), type(value).__name__)


def _join(key: str, k: str) -> str:
    return f"{key}.{k}" if key else k


def parse_campaign(data: Any, source: str = "") -> Campaign:
    """Build a Campaign from parsed JSON; raises CampaignError naming the JSON path of a problem."""
    r = _Reader(source)
    root = r.obj(
        data,
        "",
        ("schema_version", "name", "seed", "clock", "metadata", "incidents"),
        ("schema_version", "name", "incidents"),
    )
    version = r.int_(root["schema_version"], "schema_version")
    if version != SCHEMA_VERSION:
        raise r.fail("schema_version", f"only version {SCHEMA_VERSION} is supported, got {version}")
    name = r.str_(root["name"], "name")
    seed = r.int_(root.get("seed", 0), "seed")
    clock = r.obj(root.get("clock", {}), "clock", ("type", "origin"))
    clock_type = r.str_(clock.get("type", CLOCK_TYPES[0]), "clock.type", CLOCK_TYPES)
    clock_origin = r.str_(clock.get("origin", CLOCK_ORIGINS[0]), "clock.origin", CLOCK_ORIGINS)
    metadata = r.meta(root, "metadata", "")
    raw = root["incidents"]
    if not isinstance(raw, list) or not raw:
        raise r.fail("incidents", f"expected a non-empty array, got {_kind(raw)} {raw!r}"[:200])
    incidents: list[Incident] = []
    ids: set[str] = set()
    fault_ids: set[str] = set()
    for i, value in enumerate(raw):
        inc = _incident(r, value, f"incidents[{i}]", fault_ids)
        if inc.incident_id in ids:
            raise r.fail(f"incidents[{i}].incident_id", f"duplicate incident id {inc.incident_id!r}")
        ids.add(inc.incident_id)
        incidents.append(inc)
    return Campaign(
        name=name,
        seed=seed,
        incidents=tuple(incidents),
        clock_type=clock_type,
        clock_origin=clock_origin,
        metadata=metadata,
        source_dict=root,
    )


def _incident(r: _Reader, value: Any, key: str, fault_ids: set[str]) -> Incident:
    d = r.obj(
        value,
        key,
        ("incident_id", "trigger", "lifetime", "retrigger", "max_occurrences", "faults"),
        ("incident_id", "trigger", "faults"),
    )
    incident_id = r.str_(d["incident_id"], f"{key}.incident_id")
    if any(c in incident_id for c in "@#/") or incident_id.strip() != incident_id:
        raise r.fail(f"{key}.incident_id", f"must not contain '@', '#', '/' or edge spaces: {incident_id!r}")
    trigger = _trigger(r, d["trigger"], f"{key}.trigger")
    lifetime = _lifetime(r, d.get("lifetime", {"matching_calls": 1}), f"{key}.lifetime")
    retrigger = r.str_(d.get("retrigger", "once"), f"{key}.retrigger", RETRIGGERS)
    max_occ = r.opt_int(d, "max_occurrences", key, 1)
    if retrigger == "max_occurrences" and max_occ is None:
        raise r.fail(f"{key}.max_occurrences", "missing (required by retrigger 'max_occurrences')")
    if retrigger != "max_occurrences" and max_occ is not None:
        raise r.fail(
            f"{key}.max_occurrences", f"only allowed with retrigger 'max_occurrences', not {retrigger!r}"
        )
    raw = d["faults"]
    if not isinstance(raw, list) or not raw:
        raise r.fail(f"{key}.faults", f"expected a non-empty array, got {_kind(raw)}")
    faults = []
    for j, f in enumerate(raw):
        fault = _fault(r, f, f"{key}.faults[{j}]")
        if fault.fault_id in fault_ids:
            raise r.fail(f"{key}.faults[{j}].fault_id", f"duplicate fault id {fault.fault_id!r}")
        fault_ids.add(fault.fault_id)
        faults.append(fault)
    return Incident(incident_id, trigger, lifetime, retrigger, max_occ, tuple(faults))


def _trigger(r: _Reader, value: Any, key: str) -> Trigger:
    d = r.obj(value, key, ("at", "range", "probability"))
    prob = d.get("probability", 1.0)
    if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0.0 <= prob <= 1.0:
        raise r.fail(f"{key}.probability", f"expected a number in [0, 1], got {_kind(prob)} {prob!r}")
    if ("at" in d) == ("range" in d):
        raise r.fail(key, "needs exactly one of 'at' (a list of iterations) or 'range'")
    if "at" in d:
        at = d["at"]
        if not isinstance(at, list) or not at:
            raise r.fail(f"{key}.at", f"expected a non-empty array of iterations, got {_kind(at)}")
        its = tuple(r.int_(v, f"{key}.at[{i}]", 0) for i, v in enumerate(at))
        return Trigger(at=tuple(sorted(set(its))), probability=float(prob))
    rng = r.obj(d["range"], f"{key}.range", ("start", "end", "every"), ("start",))
    start = r.int_(rng["start"], f"{key}.range.start", 0)
    end = r.opt_int(rng, "end", f"{key}.range", start)
    every = r.int_(rng.get("every", 1), f"{key}.range.every", 1)
    return Trigger(start=start, end=end, every=every, probability=float(prob))


def _lifetime(r: _Reader, value: Any, key: str) -> Lifetime:
    d = r.obj(value, key, ("matching_calls", "iterations", "until"))
    if len(d) != 1:
        raise r.fail(key, "needs exactly one of 'matching_calls', 'iterations' or 'until'")
    if "until" in d:
        return Lifetime(until=r.str_(d["until"], f"{key}.until", UNTIL))
    return Lifetime(
        matching_calls=r.opt_int(d, "matching_calls", key, 1), iterations=r.opt_int(d, "iterations", key, 1)
    )


_TARGET_KEYS = (
    "surface",
    "rank",
    "model_part",
    "component",
    "index",
    "module_path",
    "operation",
    "resource",
    "path",
    "metadata",
)


def _fault(r: _Reader, value: Any, key: str) -> Fault:
    d = r.obj(value, key, ("fault_id", "type", "target", "parameters"), ("fault_id", "type", "target"))
    fault_id = r.str_(d["fault_id"], f"{key}.fault_id")
    ftype = r.str_(d["type"], f"{key}.type", sorted(CANONICAL_TYPES))
    t = r.obj(d["target"], f"{key}.target", _TARGET_KEYS, ("surface",))
    tk = f"{key}.target"
    target = Target(
        surface=r.str_(t["surface"], f"{tk}.surface", SURFACES),
        rank=r.opt_int(t, "rank", tk, 0),
        model_part=r.opt_int(t, "model_part", tk, 0),
        component=r.opt_str(t, "component", tk),
        index=r.opt_int(t, "index", tk, 0),
        module_path=r.opt_str(t, "module_path", tk),
        operation=r.opt_str(t, "operation", tk),
        resource=r.opt_str(t, "resource", tk),
        path=r.opt_str(t, "path", tk),
        metadata=r.meta(t, "metadata", tk),
    )
    params = r.meta(d, "parameters", key)
    if ftype == "tensor_corruption":
        pk = f"{key}.parameters"
        for name, choices in (
            ("operation", TENSOR_OPERATIONS),
            ("scope", TENSOR_SCOPES),
            ("magnitude", TENSOR_MAGNITUDES),
        ):
            if name in params:
                r.str_(params[name], f"{pk}.{name}", choices)
    return Fault(fault_id, ftype, target, params)


def load_campaign(path: str | os.PathLike[str]) -> Campaign:
    """Read and parse one campaign JSON file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CampaignError("campaign", f"cannot read {p}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CampaignError("campaign", f"{p} is not UTF-8 text: {exc}") from exc
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise CampaignError("campaign", f"{p} is not valid JSON: {exc}") from exc
    return parse_campaign(data, str(p))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_campaigns(path: str | os.PathLike[str]) -> list[Campaign]:
    """One campaign file, or every `*.json` in a folder (by name); names must be unique."""
    p = Path(path)
    if not p.is_dir():
        return [load_campaign(p)]
    files = sorted(f for f in p.glob("*.json") if f.is_file())
    if not files:
        raise CampaignError("campaign", f"no *.json campaign in {p}")
    out = [load_campaign(f) for f in files]
    seen: dict[str, str] = {}
    for c, f in zip(out, files, strict=True):
        if c.name in seen:
            raise CampaignError("name", f"{f.name} and {seen[c.name]} both name campaign {c.name!r}", str(f))
        seen[c.name] = f.name
    return out


# --- the schedule -------------------------------------------------------------------------------


def draw(seed: int, incident_id: str, iteration: int) -> float:
    """The incident's probability draw at an iteration: uniform in [0, 1), a function of the
    campaign seed, the incident id and the iteration only (a campaign replays identically)."""
    h = hashlib.sha256(f"{seed}\x00{incident_id}\x00{iteration}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


@dataclass(frozen=True)
class Occurrence:
    incident_id: str
    iteration: int
    attempt: int = 0  # 0: the first time at this iteration; n: the n-th retry (after recovery)

    @property
    def occurrence_id(self) -> str:
        base = f"{self.incident_id}@{self.iteration}"
        return f"{base}#{self.attempt}" if self.attempt else base

    @staticmethod
    def parse(occurrence_id: str) -> Occurrence:
        base, _, attempt = occurrence_id.partition("#")
        incident_id, sep, iteration = base.rpartition("@")
        if not sep or not incident_id or not iteration.isdigit() or (attempt and not attempt.isdigit()):
            raise ValueError(f"not an occurrence id: {occurrence_id!r}")
        return Occurrence(incident_id, int(iteration), int(attempt or 0))


class Schedule:
    """Which incidents fire at an iteration, given the occurrences that fired before (in this
    process or, from the ground-truth log, in earlier generations of the run)."""

    def __init__(self, campaign: Campaign, fired: Iterable[Occurrence] = ()) -> None:
        self.campaign = campaign
        self._fired: dict[str, list[Occurrence]] = {i.incident_id: [] for i in campaign.incidents}
        for occ in fired:
            if occ.incident_id in self._fired and occ not in self._fired[occ.incident_id]:
                self._fired[occ.incident_id].append(occ)

    def fired(self, incident_id: str) -> list[Occurrence]:
        return list(self._fired.get(incident_id, ()))

    def due(self, iteration: int) -> list[Occurrence]:
        """The occurrences that fire at `iteration` now, recorded as fired."""
        out = []
        for inc in self.campaign.incidents:
            occ = self._next(inc, iteration)
            if occ is not None:
                self._fired[inc.incident_id].append(occ)
                out.append(occ)
        return out

    def _next(self, inc: Incident, iteration: int) -> Occurrence | None:
        if not inc.trigger.matches(iteration):
            return None
        if draw(self.campaign.seed, inc.incident_id, iteration) >= inc.trigger.probability:
            return None
        before = self._fired[inc.incident_id]
        here = sum(1 for o in before if o.iteration == iteration)
        if inc.retrigger == "once" and here:
            return None  # a replay of the iteration after recovery does not fire it again
        if inc.max_occurrences is not None and len(before) >= inc.max_occurrences:
            return None
        return Occurrence(inc.incident_id, iteration, here)
