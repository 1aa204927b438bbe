"""islands.regions: each other region's island count as its quota of the records the other
regions share (issue 46: regions of unequal size got a max-min split, so a region of 3 could
lose its third record to a region of 1). Hand-derived cases of the spec's validation,
admission.room_for and admitted_records with quotas (each beside what the max-min split would
do), then the same through a real Syncer (join, leave, the admin route, push slots)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from diloco_trainer import cli
from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import IslandStatus
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.syncer.edge.http import SyncerRoutes
from diloco_trainer.syncer.edge.limits import HttpLimits
from diloco_trainer.syncer.intake.admission import Admission, Room, admitted_records
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import DROPPED, LEFT, IslandRecord
from diloco_trainer.syncer.state.rounds import Refused

from .test_syncer import FakeClock, make_spec, run, started

# One local island ('us') of a job of 5: the other regions share R = 5 - 1 = 4 records, eu's
# 3 and ap's 1 by the spec.
ISLANDS: dict[str, Any] = {"count": 1, "totalShards": 5, "namePrefix": "us"}
REGIONS = [{"namePrefix": "eu", "count": 3}, {"namePrefix": "ap", "count": 1}]
QUOTAS = Admission.from_spec(parse_spec({"islands": {**ISLANDS, "regions": REGIONS}}))
MAX_MIN = Admission.from_spec(parse_spec({"islands": ISLANDS}))


def records(*specs: tuple[str, str, float]) -> dict[str, IslandRecord]:
    return {n: IslandRecord(n, state=s, last_seen=t) for n, s, t in specs}


def test_region_quota_spec_validation_names_the_field() -> None:
    assert QUOTAS.quotas == (("eu", 3), ("ap", 1))
    assert (QUOTAS.quota("eu"), QUOTAS.quota("ap"), QUOTAS.quota("xx")) == (3, 1, 0)
    assert MAX_MIN.quota("eu") is None
    # At most R = 4 in all; fewer is fine (the rest is nobody's).
    parse_spec({"islands": {**ISLANDS, "regions": [{"namePrefix": "eu", "count": 2}]}})
    bad = {
        "islands.regions counts 5 islands in all, more than the other regions have: "
        "totalShards - count = 4": [{"namePrefix": "eu", "count": 4}, REGIONS[1]],
        "islands.regions names this cluster's own prefix 'us'": [{"namePrefix": "us", "count": 1}],
        "islands.regions names a prefix twice": [REGIONS[1], REGIONS[1]],
        "islands.regions.0.count": [{"namePrefix": "eu", "count": 0}],
        "islands.regions.0.namePrefix": [{"namePrefix": "EU", "count": 1}],
    }
    for message, regions in bad.items():
        with pytest.raises(ConfigError) as err:
            parse_spec({"islands": {**ISLANDS, "regions": regions}})
        assert message in str(err.value), (message, str(err.value))
    with pytest.raises(ConfigError, match="totalShards - count = 0"):  # not multi-region
        parse_spec({"islands": {"count": 2, "regions": [REGIONS[1]]}})


def test_region_quota_check_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "islands: {count: 1, totalShards: 3, regions: [{namePrefix: eu, count: 3}]}\n"
    )
    assert cli.main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert "islands.regions counts 3 islands in all" in err and "Traceback" not in err, err


def test_region_quota_refuses_an_unlisted_region() -> None:
    refusal = QUOTAS.refusal("xx-island-2")
    assert refusal is not None and refusal.status == 503
    assert refusal.code == protocol.ERROR_NOT_ADMITTED and "islands.regions" in refusal.message
    assert QUOTAS.refusal("eu-island-4") is None and QUOTAS.refusal("ap-island-0") is None
    assert MAX_MIN.refusal("xx-island-2") is None  # without quotas any prefix may ask


def test_region_quota_room_keeps_each_region_to_its_count() -> None:
    eu = records(("eu-island-0", "active", 1.0), ("eu-island-1", "active", 2.0))
    # eu below its 3: a free record (3 of R = 4 taken after it).
    assert QUOTAS.room_for(eu, "eu-island-2") == Room(False, None)
    eu["eu-island-2"] = IslandRecord("eu-island-2", last_seen=3.0)
    # eu at its 3: refused although one record is free (max-min: eu could take the 4th).
    assert QUOTAS.room_for(eu, "eu-island-3") == Room(True, None)
    assert MAX_MIN.room_for(eu, "eu-island-3") == Room(False, None)
    assert QUOTAS.room_for(eu, "ap-island-0") == Room(False, None)
    full = {**eu, "ap-island-0": IslandRecord("ap-island-0", last_seen=4.0)}
    # ap at its 1 cannot take eu's third (max-min: eu 3 >= 1 + 2 gives back its longest silent).
    assert QUOTAS.room_for(full, "ap-island-1") == Room(True, None)
    assert MAX_MIN.room_for(full, "ap-island-1") == Room(True, "eu-island-0")
    # A gone record is its own region's only: eu's left one goes to eu, never to ap.
    full["eu-island-1"] = IslandRecord("eu-island-1", state=LEFT, last_seen=2.0)
    assert QUOTAS.room_for(full, "eu-island-3") == Room(True, "eu-island-1")
    assert QUOTAS.room_for(full, "ap-island-1") == Room(True, None)
    assert MAX_MIN.room_for(full, "ap-island-1") == Room(True, "eu-island-1")
    # An admin drop frees ap's record for ap; a drop for refused pushes does not.
    full["ap-island-0"] = IslandRecord("ap-island-0", state=DROPPED, reason="squat")
    assert QUOTAS.room_for(full, "ap-island-1") == Room(True, "ap-island-0")
    full["ap-island-0"] = IslandRecord(
        "ap-island-0", state=DROPPED, reason=f"{protocol.DROPPED_FOR_REFUSALS}: 5 in a row"
    )
    assert QUOTAS.room_for(full, "ap-island-1") == Room(True, None)
    assert QUOTAS.room_for(full, "ap-island-0") == Room(False, None)  # known: no room needed


def test_region_quota_room_takes_back_records_beyond_a_count() -> None:
    # Records of an older spec (or none): eu holds all 4; ap (below its 1) takes one of eu's,
    # the gone one first, else the longest silent.
    eu = records(*((f"eu-island-{i}", "active", float(10 - i)) for i in range(4)))
    assert QUOTAS.room_for(eu, "ap-island-0") == Room(True, "eu-island-3")
    eu["eu-island-0"] = IslandRecord("eu-island-0", state=LEFT, last_seen=10.0)
    assert QUOTAS.room_for(eu, "ap-island-0") == Room(True, "eu-island-0")
    # eu is above its 3: it takes nothing new.
    assert QUOTAS.room_for(eu, "eu-island-5") == Room(True, "eu-island-0")  # only its own gone
    del eu["eu-island-0"]
    assert QUOTAS.room_for(eu, "eu-island-5") == Room(True, None)


def test_region_quota_restored_records_keep_each_regions_count() -> None:
    doc = {f"eu-island-{i}": IslandStatus(state="active", last_seen=10.0 + i) for i in range(4)}
    doc["ap-island-0"] = IslandStatus(state="active", last_seen=1.0)
    doc["xx-island-0"] = IslandStatus(state="active", last_seen=20.0)  # not listed
    doc["us-island-0"] = IslandStatus(state="active", last_seen=0.0)
    kept, left_out = admitted_records(QUOTAS, doc)
    # eu's 3 newest, ap's 1; xx is not admitted at all.
    assert sorted(kept) == [
        "ap-island-0",
        "eu-island-1",
        "eu-island-2",
        "eu-island-3",
        "us-island-0",
    ]
    assert left_out == ["eu-island-0", "xx-island-0"]
    # Max-min over R = 4: each region's newest (xx-0, eu-3, ap-0), then eu-2.
    kept, _ = admitted_records(MAX_MIN, doc)
    assert sorted(kept) == [
        "ap-island-0",
        "eu-island-2",
        "eu-island-3",
        "us-island-0",
        "xx-island-0",
    ]


def test_region_quota_syncer_join_drop_and_push_slots(tmp_path: Path) -> None:
    """2 local islands of 5: R = 3, eu 2 and ap 1. eu cannot take a third record nor ap a
    second; the admin's drop of ap's record frees it for ap, not eu; push slots follow the
    counts."""
    clock = FakeClock()
    spec = make_spec(
        islands={
            "count": 2,
            "totalShards": 5,
            "regions": [{"namePrefix": "eu", "count": 2}, {"namePrefix": "ap", "count": 1}],
        }
    )

    async def scenario() -> tuple[list[str], Syncer]:
        syncer = await started(spec, tmp_path, clock)
        members = syncer.state.membership
        got = []
        for name in ("eu-island-0", "eu-island-1", "ap-island-0"):
            await syncer.islands.join(name, 1)
            clock.now += 1
        for name in ("eu-island-2", "ap-island-1"):
            with pytest.raises(Refused) as err:
                await syncer.islands.join(name, 1)
            got.append(f"{name} {err.value.status} {err.value.code}")
            assert "islands.regions count" in err.value.message, err.value.message
        await syncer.islands.set_membership("ap-island-0", "dropped", "squatting")
        with pytest.raises(Refused):
            await syncer.islands.join("eu-island-2", 1)  # ap's freed record is not eu's
        await syncer.islands.join("ap-island-1", 1)
        got.append(",".join(sorted(members.islands)))
        return got, syncer

    got, syncer = run(scenario())
    assert got == [
        f"eu-island-2 503 {protocol.ERROR_NOT_ADMITTED}",
        f"ap-island-1 503 {protocol.ERROR_NOT_ADMITTED}",
        "ap-island-1,eu-island-0,eu-island-1",
    ]
    # 'auto' push slots 2 x 5 + 2 = 12, of which the local islands keep 2 x 2: eu's 2 records
    # hold 4, ap's 1 holds 2.
    routes = SyncerRoutes(syncer, "tok", HttpLimits.from_spec(spec))
    assert routes.push_slots.size == 12
    assert syncer.region_islands("eu") == (2, 2) and syncer.region_islands("ap") == (1, 2)
    assert routes._push_share(Principal(credentials.REGION, "eu")) == 4
    assert routes._push_share(Principal(credentials.REGION, "ap")) == 2
