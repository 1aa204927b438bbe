"""Other regions' island records and push slots, split fairly among the regions (issue 46): a
remote region's credential took every record other regions share and kept them through an admin
drop and its own leave, and held all but two push slots. Hand-derived cases of
admission.room_for, admitted_records and limits.push_share, then the same through a real Syncer
(its join, leave and admin routes, and the push slots its HTTP edge gives a region)."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import IslandStatus
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.edge.http import SyncerRoutes
from diloco_trainer.syncer.edge.limits import HttpLimits
from diloco_trainer.syncer.intake.admission import Admission, Room, admitted_records, gone_remote
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import DROPPED, LEFT, TIMED_OUT, IslandRecord
from diloco_trainer.syncer.state.rounds import Refused

from .test_syncer import FakeClock, make_spec, run, started

# One local island ('us') of a job of 4: the other regions share R = 4 - 1 = 3 records.
ADMISSION = Admission.from_spec(
    parse_spec({"islands": {"count": 1, "totalShards": 4, "namePrefix": "us"}})
)


def records(*specs: tuple[str, str, float]) -> dict[str, IslandRecord]:
    return {n: IslandRecord(n, state=s, last_seen=t) for n, s, t in specs}


def test_region_room_takes_from_a_region_two_above_the_newcomer() -> None:
    # eu took all 3 while nobody else asked (the side was not full: each join admitted).
    held = records(
        ("eu-island-0", "active", 3.0),
        ("eu-island-1", "active", 1.0),
        ("eu-island-2", "active", 2.0),
    )
    assert ADMISSION.room_for(held, "ap-island-0") == Room(True, "eu-island-1")  # 3 >= 0 + 2
    del held["eu-island-1"]
    held["ap-island-0"] = IslandRecord("ap-island-0", last_seen=4.0)
    # eu 2, ap 1: 2 >= 1 + 2 is false, an equal split as near as 3 allows: no room for either.
    assert ADMISSION.room_for(held, "ap-island-1") == Room(True, None)
    assert ADMISSION.room_for(held, "eu-island-1") == Room(True, None)
    assert ADMISSION.room_for(held, "eu-island-0") == Room(False, None)  # known: no room needed
    assert ADMISSION.room_for(held, "us-island-0") == Room(False, None)  # the local side
    assert ADMISSION.room_for({}, "eu-island-2") == Room(False, None)
    # A third region takes from the fullest (eu 2 >= 0 + 2), not from ap (1).
    assert ADMISSION.room_for(held, "xx-island-0") == Room(True, "eu-island-2")


def test_region_room_gone_records_first_own_region_then_fullest() -> None:
    held = records(
        ("eu-island-0", "active", 5.0),
        ("eu-island-1", LEFT, 4.0),
        ("ap-island-0", TIMED_OUT, 1.0),
    )
    # Gone: eu-island-1 and ap-island-0. ap's newcomer takes its own region's first...
    assert ADMISSION.room_for(held, "ap-island-1") == Room(True, "ap-island-0")
    # ...eu's its own too, a third region's the fullest region's (eu holds 2, ap 1).
    assert ADMISSION.room_for(held, "eu-island-2") == Room(True, "eu-island-1")
    assert ADMISSION.room_for(held, "xx-island-0") == Room(True, "eu-island-1")
    # An admin drop frees a record; a drop for refused pushes does not (a rejoin would forget
    # it), but still counts as its region's: held(eu) = 3 >= 0 + 2.
    admin = IslandRecord("eu-island-2", state=DROPPED, reason="pods failing", last_seen=9.0)
    refused = IslandRecord(
        "eu-island-2", state=DROPPED, reason=f"{protocol.DROPPED_FOR_REFUSALS}: 5 in a row"
    )
    assert gone_remote(admin) and not gone_remote(refused)
    assert not gone_remote(IslandRecord("eu-island-0"))
    eu = records(("eu-island-0", "active", 5.0), ("eu-island-1", "active", 6.0))
    assert ADMISSION.room_for({**eu, "eu-island-2": admin}, "ap-island-0") == Room(
        True, "eu-island-2"
    )
    assert ADMISSION.room_for({**eu, "eu-island-2": refused}, "ap-island-0") == Room(
        True,
        "eu-island-2",  # over the split: dropped ones of the fullest region first
    )
    # The local side keeps its rule: only timed out or left records, never a dropped one.
    local = Admission.from_spec(parse_spec({"islands": {"count": 2, "totalShards": 4}}))
    own = records(("island-0", DROPPED, 0.0), ("island-5", LEFT, 1.0))
    assert local.room_for(own, "island-1") == Room(True, "island-5")
    del own["island-5"]
    own["island-1"] = IslandRecord("island-1", state=DROPPED)
    assert local.room_for(own, "island-3") == Room(True, None)


def test_region_restored_records_are_split_per_region() -> None:
    doc = {f"eu-island-{i}": IslandStatus(state="active", last_seen=10.0 + i) for i in range(3)}
    doc["ap-island-0"] = IslandStatus(state="active", last_seen=1.0)  # the oldest of all
    doc["us-island-0"] = IslandStatus(state="active", last_seen=0.0)
    kept, left_out = admitted_records(ADMISSION, doc)
    # R = 3: each region's newest first (eu-2, ap-0), then each one's second (eu-1).
    assert sorted(kept) == ["ap-island-0", "eu-island-1", "eu-island-2", "us-island-0"]
    assert left_out == ["eu-island-0"]
    assert ADMISSION.held_by(kept, "eu") == 2 and ADMISSION.held_by(kept, "us") == 1


def test_region_syncer_admin_drop_and_leave_free_a_squatters_records(tmp_path: Path) -> None:
    """2 local islands of 4: R = 2. eu takes both; ap gets one back at once (2 >= 0 + 2), then
    eu's admin-dropped record and eu's left one go to ap's second island; eu cannot take them
    back beyond the equal split."""
    clock = FakeClock()
    spec = make_spec(islands={"count": 2, "totalShards": 4})

    async def scenario() -> tuple[list[str], Syncer]:
        syncer = await started(spec, tmp_path, clock)
        members = syncer.state.membership
        got = []
        for name in ("eu-island-0", "eu-island-1"):
            await syncer.islands.join(name, 1)
            clock.now += 1
        await syncer.islands.join("ap-island-0", 1)  # takes eu-island-0 (the longer silent)
        got.append(",".join(sorted(members.islands)))
        for name in ("ap-island-1", "eu-island-0"):  # 1 and 1: neither may take more
            with pytest.raises(Refused) as err:
                await syncer.islands.join(name, 1)
            got.append(f"{name} {err.value.status} {err.value.code}")
        await syncer.islands.set_membership("eu-island-1", "dropped", "squatting")
        await syncer.islands.join("ap-island-1", 1)  # the admin's drop freed it
        got.append(",".join(sorted(members.islands)))
        await syncer.islands.leave("ap-island-1")
        await syncer.islands.join("eu-island-1", 1)  # a left record: anyone's
        got.append(",".join(sorted(members.islands)))
        return got, syncer

    got, syncer = run(scenario())
    assert got == [
        "ap-island-0,eu-island-1",
        f"ap-island-1 503 {protocol.ERROR_NOT_ADMITTED}",
        f"eu-island-0 503 {protocol.ERROR_NOT_ADMITTED}",
        "ap-island-0,ap-island-1",
        "ap-island-0,eu-island-1",
    ]
    # A region's push slots follow its records: 'auto' is 2 x 4 + 2 = 10; eu holds 1: 2 slots
    # (within 10 - 2 x 2 local islands); ap 1: 2; the local prefix ('') none joined: one
    # island's 2.
    routes = SyncerRoutes(syncer, "tok", HttpLimits.from_spec(spec))
    assert routes.push_slots.size == 10
    assert syncer.region_islands("eu") == (1, 2) and syncer.region_islands("") == (0, 0)
    assert routes._push_share(Principal(credentials.REGION, "eu")) == 2
    assert routes._push_share(Principal(credentials.REGION, "")) == 2
    assert routes._push_share(Principal(credentials.ISLAND, "island-0")) == 2
