"""The job's credentials (api/credentials.py): what each derives, verifies as, and may do."""

from __future__ import annotations

import pytest
from diloco_trainer.api import credentials
from diloco_trainer.api.credentials import (
    ADMIN,
    ISLAND,
    REGION,
    ROOT,
    CredentialError,
    Issuer,
    Principal,
)

ROOT_TOKEN = "r" * 43
OTHER_ROOT = "s" * 43


def test_credentials_each_kind_verifies_as_itself_and_only_under_its_root() -> None:
    cases = {
        ROOT_TOKEN: Principal(ROOT),
        credentials.admin_token(ROOT_TOKEN): Principal(ADMIN),
        credentials.region_token(ROOT_TOKEN, "eu"): Principal(REGION, "eu"),
        credentials.region_token(ROOT_TOKEN, ""): Principal(REGION, ""),
        credentials.island_token(ROOT_TOKEN, "eu-island-3"): Principal(ISLAND, "eu-island-3"),
    }
    for token, principal in cases.items():
        assert credentials.verify(ROOT_TOKEN, token) == principal, token
        assert credentials.verify(OTHER_ROOT, token) is None, token


def test_credentials_refuse_forged_and_malformed_tokens() -> None:
    island = credentials.island_token(ROOT_TOKEN, "island-0")
    forged_scope = island.replace("island-0", "island-1")  # the MAC of another island's name
    forged_kind = island.replace(".island.", ".admin.", 1)
    flipped = island[:-1] + ("A" if island[-1] != "A" else "B")
    for token in (
        "",
        forged_scope,
        forged_kind,
        flipped,
        "dlc1.island.island-0",
        "dlc1.root..abc",
        "dlc1.island.not an island.abc",
        "dlc1.admin.x." + island.rsplit(".", 1)[1],
        ROOT_TOKEN + " ",
    ):
        assert credentials.verify(ROOT_TOKEN, token) is None, token


def test_credentials_region_derives_exactly_its_islands() -> None:
    region = Issuer.of(credentials.region_token(ROOT_TOKEN, "eu"))
    assert region.kind == REGION
    # The same credential as the root derives: the syncer (root only) accepts it.
    assert region.island_token("eu-island-7") == credentials.island_token(ROOT_TOKEN, "eu-island-7")
    for other in ("island-7", "us-island-7", "eu-x-island-7", "eu"):
        with pytest.raises(CredentialError):
            region.island_token(other)
    assert region.operator_token() == region.credential  # it calls the syncer as itself


def test_credentials_root_issuer_calls_the_syncer_as_admin() -> None:
    root = Issuer.of(ROOT_TOKEN)
    assert root.kind == ROOT
    assert credentials.verify(ROOT_TOKEN, root.operator_token()) == Principal(ADMIN)
    assert root.island_token("island-0") == credentials.island_token(ROOT_TOKEN, "island-0")


def test_credentials_admin_and_island_credentials_cannot_issue() -> None:
    for token in (
        credentials.admin_token(ROOT_TOKEN),
        credentials.island_token(ROOT_TOKEN, "island-0"),
    ):
        with pytest.raises(CredentialError, match="root token or a region credential"):
            Issuer.of(token)


def test_credentials_fingerprint_names_the_credential_without_revealing_it() -> None:
    first, second = Issuer.of(ROOT_TOKEN), Issuer.of(OTHER_ROOT)
    assert first.fingerprint() == Issuer.of(ROOT_TOKEN).fingerprint()
    assert first.fingerprint() != second.fingerprint()
    assert ROOT_TOKEN[:8] not in first.fingerprint() and len(first.fingerprint()) == 16


@pytest.mark.parametrize(
    ("principal", "acts_as", "manages"),
    [
        (Principal(ROOT), {"island-0", "eu-island-0"}, {"island-0", "eu-island-0"}),
        (Principal(ADMIN), set(), {"island-0", "eu-island-0"}),
        (Principal(REGION, "eu"), {"eu-island-0"}, {"eu-island-0"}),
        (Principal(REGION, ""), {"island-0"}, {"island-0"}),
        (Principal(ISLAND, "island-0"), {"island-0"}, set()),
    ],
)
def test_credentials_principal_may_act_as_and_manage_only_its_scope(
    principal: Principal, acts_as: set[str], manages: set[str]
) -> None:
    names = {"island-0", "eu-island-0"}
    assert {n for n in names if principal.may_act_as(n)} == acts_as
    assert {n for n in names if principal.may_set_membership(n)} == manages
    assert not principal.may_act_as("not-an-island") or principal.kind == ROOT


def test_credentials_region_of_parses_island_names() -> None:
    assert credentials.region_of("island-3") == ""
    assert credentials.region_of("eu-west-island-12") == "eu-west"
    assert credentials.region_of("island-") is None and credentials.region_of("Eu-island-1") is None
