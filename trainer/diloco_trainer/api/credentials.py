"""A job's credentials: who may call what on its syncer (torch-free, stdlib only).

The syncer holds one secret, the job's root token (the Secret `NAME-token`, or the user's
spec.syncer.tokenSecretName). Every other credential is derived from it with HMAC-SHA256, so the
syncer checks a credential by deriving it again, and nothing but the root has to be stored or
shared between processes:

- root (the token itself): everything. Only the syncer and the operator of the syncer's cluster
  (which derives the others from it) hold it.
- admin, ``dlc1.admin..MAC``: the membership route (PUT /v1/islands/{island}) for any island and
  the read-only routes. What the operator calls the syncer with.
- region, ``dlc1.region.PREFIX.MAC``: for the islands named ``PREFIX-island-N`` (``island-N``
  when PREFIX is empty), what an island credential may do plus the membership route; it derives
  the island credentials of those islands. What the operator of another cluster of a
  multi-region job holds instead of the root.
- island, ``dlc1.island.NAME.MAC``: join, push, heartbeat and leave as island NAME only, plus
  the read-only routes (status, metrics, pulling fragments). One per island, mounted only in that
  island's pods.

An island credential is derived from its region's (MAC of the island name under the region's MAC
as key), so a region credential derives exactly its own islands' credentials and nobody else's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Literal

VERSION = "dlc1"
Kind = Literal["root", "admin", "region", "island"]
ROOT: Kind = "root"
ADMIN: Kind = "admin"
REGION: Kind = "region"
ISLAND: Kind = "island"

# contract.island_name's names: '[prefix-]island-N' with a DNS-label prefix (spec.namePrefix).
ISLAND_NAME = re.compile(r"^(?:(?P<prefix>[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)-)?island-\d{1,6}$")
REGION_PREFIX = re.compile(r"^(?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)?$")
# An empty root is refused where one is read (contract.read_token); the operator generates 32 bytes.
MIN_ROOT_LENGTH = 1


class CredentialError(ValueError):
    """A credential that cannot be used as asked; the message says why."""


@dataclass(frozen=True)
class Principal:
    """Who a verified credential speaks for: its kind and scope (a region prefix or an island
    name; empty for root and admin)."""

    kind: Kind
    scope: str = ""

    def may_act_as(self, island: str) -> bool:
        """Whether it may join, push, heartbeat and leave as `island`."""
        if self.kind == ROOT:
            return True
        if self.kind == ISLAND:
            return island == self.scope
        if self.kind == REGION:
            return region_of(island) == self.scope
        return False

    def may_set_membership(self, island: str) -> bool:
        """Whether it may drop or re-add `island` (the operator's membership route)."""
        if self.kind in (ROOT, ADMIN):
            return True
        return self.kind == REGION and region_of(island) == self.scope

    def describe(self) -> str:
        """Words for refusals and logs: 'the root token', 'the island credential of island-2'."""
        if self.kind in (ROOT, ADMIN):
            return f"the {self.kind} credential"
        return f"the {self.kind} credential of {self.scope or 'the unprefixed islands'}"


def region_of(island: str) -> str | None:
    """The prefix of an island name ('' for 'island-N'), None when it is not an island name."""
    match = ISLAND_NAME.match(island)
    if match is None:
        return None
    return match.group("prefix") or ""


def _mac(key: bytes, label: str) -> bytes:
    return hmac.new(key, f"{VERSION}/{label}".encode(), hashlib.sha256).digest()


def _encode(mac: bytes) -> str:
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def _decode(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        raise CredentialError("credential MAC is not base64url") from None


def _token(kind: Kind, scope: str, mac: bytes) -> str:
    return f"{VERSION}.{kind}.{scope}.{_encode(mac)}"


def _check_root(root: str) -> bytes:
    if len(root) < MIN_ROOT_LENGTH:
        raise CredentialError(f"the root token must be at least {MIN_ROOT_LENGTH} characters")
    return root.encode()


def _region_mac(root: str, prefix: str) -> bytes:
    if not REGION_PREFIX.match(prefix):
        raise CredentialError(f"{prefix!r} is not an island name prefix")
    return _mac(_check_root(root), f"region/{prefix}")


def admin_token(root: str) -> str:
    """The admin credential of the job whose root token is `root`."""
    return _token(ADMIN, "", _mac(_check_root(root), "admin"))


def region_token(root: str, prefix: str) -> str:
    """The region credential of the islands named `prefix`-island-N."""
    return _token(REGION, prefix, _region_mac(root, prefix))


def _island_from_region_mac(region_mac: bytes, island: str) -> str:
    return _token(ISLAND, island, _mac(region_mac, f"island/{island}"))


def island_token(root: str, island: str) -> str:
    """The island credential of `island`, derived from the root token."""
    prefix = region_of(island)
    if prefix is None:
        raise CredentialError(f"{island!r} is not an island name ([prefix-]island-N)")
    return _island_from_region_mac(_region_mac(root, prefix), island)


def parse(token: str) -> tuple[Kind, str, bytes] | None:
    """(kind, scope, MAC) of a derived credential; None for anything else (e.g. a root)."""
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != VERSION or parts[1] not in (ADMIN, REGION, ISLAND):
        return None
    kind: Kind = parts[1]  # narrowed to the three derived kinds by the check above
    try:
        return kind, parts[2], _decode(parts[3])
    except CredentialError:
        return None


def verify(root: str, token: str) -> Principal | None:
    """Who `token` speaks for at the syncer holding `root`; None when it is no credential of the
    job (compared in constant time)."""
    if not token:
        return None
    if hmac.compare_digest(token.encode(), root.encode()):
        return Principal(ROOT)
    parsed = parse(token)
    if parsed is None:
        return None
    kind, scope, _ = parsed
    try:
        if kind == ADMIN:
            expected = admin_token(root) if scope == "" else ""
        elif kind == REGION:
            expected = region_token(root, scope)
        else:
            expected = island_token(root, scope)
    except CredentialError:
        return None
    if expected and hmac.compare_digest(token.encode(), expected.encode()):
        return Principal(kind, scope)
    return None


@dataclass(frozen=True)
class Issuer:
    """What the operator of one cluster holds (the root, or a region credential) and what it
    derives from it: its own credential for the syncer and its islands' credentials."""

    credential: str

    @property
    def kind(self) -> Kind:
        """ROOT or REGION (anything else cannot issue: CredentialError from `of`)."""
        parsed = parse(self.credential)
        return ROOT if parsed is None else parsed[0]

    @classmethod
    def of(cls, credential: str) -> Issuer:
        """The issuer holding `credential`; CredentialError when it cannot derive islands'
        credentials (an admin or island credential, a root that is too short)."""
        parsed = parse(credential)
        if parsed is None:
            _check_root(credential)
        elif parsed[0] != REGION:
            raise CredentialError(
                f"the token Secret holds an {parsed[0]} credential: it needs the job's root "
                "token or a region credential"
            )
        return cls(credential)

    def operator_token(self) -> str:
        """What the operator calls the syncer with: admin (from a root) or the region's own."""
        return admin_token(self.credential) if self.kind == ROOT else self.credential

    def island_token(self, island: str) -> str:
        """The credential of `island`; CredentialError outside a region credential's islands."""
        parsed = parse(self.credential)
        if parsed is None:
            return island_token(self.credential, island)
        _, prefix, region_mac = parsed
        if region_of(island) != prefix:
            raise CredentialError(
                f"the region credential of prefix {prefix!r} cannot issue one for {island!r}: "
                "spec.islands.namePrefix must be the region's prefix"
            )
        return _island_from_region_mac(region_mac, island)

    def fingerprint(self) -> str:
        """A short digest naming this credential (it changes when the credential is rotated)
        without revealing it: pod templates carry it, so a rotation restarts their pods."""
        return hmac.new(self.credential.encode(), b"dlc1/fingerprint", "sha256").hexdigest()[:16]
