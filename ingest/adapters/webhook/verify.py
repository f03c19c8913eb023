"""Who signed a webhook delivery: Standard Webhooks 1.0, GitHub and Stripe.

Each mode is checked in two steps, cheapest first: :meth:`Scheme.check_headers`
before the body is read (the headers present, the timestamp fresh), then
:meth:`Scheme.verify` over the body (the HMAC-SHA256 of what the sender
signed, compared in constant time with every signature it sent, under every
configured secret: rotation). A failure raises :class:`Refused`; nothing
about a refused request is stored. Nothing here knows HTTP beyond header
names, or the database.

The delivery id (the key's last part) is the sender's: ``webhook-id``
(signed), ``X-GitHub-Delivery`` (not signed: GitHub signs the body only) or
the Stripe event's ``id`` (inside the signed body). It is checked to be a
short printable token, so it can never change the key's shape.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ingest.config.webhook import Secret, WebhookConfig

HMAC_SHA256 = "hmac-sha256"
# A delivery id: printable ASCII without spaces or ':', as Svix's, GitHub's
# GUIDs and Stripe's event ids are; bounded, as it goes into the key, whose
# parts ':' separates (no id can take the shape of a derived key's tail).
_DELIVERY_ID = re.compile(r"[\x21-\x39\x3b-\x7e]{1,200}")
_TIMESTAMP = re.compile(r"\d{1,12}")
Headers = Mapping[str, str]


class Refused(Exception):
    """A delivery that is not answered 2xx. ``reason`` is the metric's label
    and the log's, a fixed word (never the request's text)."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason


def unauthorized(reason: str, detail: str) -> Refused:
    return Refused(401, reason, detail)


@dataclass(frozen=True, slots=True)
class Signed:
    """What the headers say, before the body is read."""

    delivery_id: str | None  # None: inside the body (Stripe)
    timestamp: str | None
    signatures: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Verified:
    delivery_id: str
    secret: str  # the name of the variable whose secret matched
    trust_mode: str = HMAC_SHA256


def _header(headers: Headers, *names: str) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


def _required(headers: Headers, *names: str) -> str:
    value = _header(headers, *names)
    if value is None:
        raise unauthorized("missing_header", f"header {names[0]} is missing")
    return value


def _delivery_id(value: str, where: str) -> str:
    if not _DELIVERY_ID.fullmatch(value):
        raise Refused(
            400, "bad_delivery_id", f"{where} must be 1 to 200 printable characters without spaces or ':'"
        )
    return value


def _fresh(timestamp: str, tolerance_s: int, now: float) -> None:
    if not _TIMESTAMP.fullmatch(timestamp):
        raise unauthorized("bad_timestamp", "the timestamp is no number of seconds")
    if abs(now - int(timestamp)) > tolerance_s:
        raise unauthorized("stale_timestamp", f"the timestamp is more than {tolerance_s} s from now")


def _matching(
    secrets: Sequence[Secret], signatures: Sequence[str], expected: Callable[[bytes], str]
) -> str | None:
    """The name of the first secret under which one of ``signatures`` is
    right, each compared in constant time."""
    for secret in secrets:
        want = expected(secret.key).encode()
        for sig in signatures:
            if hmac.compare_digest(want, sig.encode()):
                return secret.name
    return None


class Scheme:
    """One mode's checks, for one adapter."""

    name: str
    # Whether the signature covers the delivery id. Where it does, the id
    # names one message: a stored id met with another body is its sender's
    # resend, serialized anew, and a duplicate. Where it does not (GitHub's
    # X-GitHub-Delivery), anyone holding one signed body can send it under
    # another delivery's id, so the id names nothing and a different body
    # under a stored id is stored as its own message (issue 43).
    signs_delivery_id: bool = True

    def __init__(self, cfg: WebhookConfig, secrets: Sequence[Secret], clock: Callable[[], float]) -> None:
        self._cfg = cfg
        self._secrets = tuple(secrets)
        self._clock = clock

    def check_headers(self, headers: Headers) -> Signed:
        raise NotImplementedError

    def verify(self, signed: Signed, body: bytes) -> Verified:
        raise NotImplementedError

    def _verified(self, matched: str | None, delivery_id: str) -> Verified:
        if matched is None:
            raise unauthorized("bad_signature", "no signature matches any of the adapter's secrets")
        return Verified(delivery_id=delivery_id, secret=matched)


class StandardWebhooks(Scheme):
    """Standard Webhooks 1.0: ``webhook-id``, ``webhook-timestamp`` and
    ``webhook-signature`` (or Svix's ``svix-*`` names); the signature is the
    base64 HMAC-SHA256 of ``id.timestamp.body`` under the secret's decoded
    bytes, several ``v1,`` ones separated by spaces. Asymmetric ``v1a``
    (ed25519) signatures are not accepted: such a delivery is refused."""

    name = "standard-webhooks"

    def check_headers(self, headers: Headers) -> Signed:
        delivery_id = _delivery_id(_required(headers, "webhook-id", "svix-id"), "webhook-id")
        timestamp = _required(headers, "webhook-timestamp", "svix-timestamp")
        _fresh(timestamp, self._cfg.tolerance_s, self._clock())
        listed = _required(headers, "webhook-signature", "svix-signature").split()
        signatures = tuple(sig for version, _, sig in (s.partition(",") for s in listed) if version == "v1")
        if not signatures:
            raise unauthorized("bad_signature", "webhook-signature holds no v1 signature")
        return Signed(delivery_id, timestamp, signatures)

    def verify(self, signed: Signed, body: bytes) -> Verified:
        assert signed.delivery_id is not None
        prefix = f"{signed.delivery_id}.{signed.timestamp}.".encode()

        def expected(key: bytes) -> str:
            return base64.b64encode(hmac.digest(key, prefix + body, hashlib.sha256)).decode()

        return self._verified(_matching(self._secrets, signed.signatures, expected), signed.delivery_id)


class GitHub(Scheme):
    """GitHub: ``X-Hub-Signature-256: sha256=HEX``, the HMAC-SHA256 of the
    body under the secret as written; the delivery id ``X-GitHub-Delivery``.
    No timestamp and the id unsigned: only the dedup horizon stops a replay
    of a captured delivery under its own id (docs/webhooks.md)."""

    name = "github"
    signs_delivery_id = False  # GitHub signs the body only

    def check_headers(self, headers: Headers) -> Signed:
        delivery_id = _delivery_id(_required(headers, "x-github-delivery"), "X-GitHub-Delivery")
        scheme, _, signature = _required(headers, "x-hub-signature-256").partition("=")
        if scheme != "sha256" or not signature:
            raise unauthorized("bad_signature", "X-Hub-Signature-256 is not sha256=HEX")
        return Signed(delivery_id, None, (signature.lower(),))

    def verify(self, signed: Signed, body: bytes) -> Verified:
        assert signed.delivery_id is not None

        def expected(key: bytes) -> str:
            return hmac.digest(key, body, hashlib.sha256).hex()

        return self._verified(_matching(self._secrets, signed.signatures, expected), signed.delivery_id)


class Stripe(Scheme):
    """Stripe: ``Stripe-Signature: t=TS,v1=HEX[,v1=HEX...]``, the HMAC-SHA256
    of ``TS.body`` under the whole ``whsec_...`` string; the delivery id is
    the event's ``id`` in the (signed) body."""

    name = "stripe"

    def check_headers(self, headers: Headers) -> Signed:
        items = [item.partition("=") for item in _required(headers, "stripe-signature").split(",")]
        timestamps = [value.strip() for key, _, value in items if key.strip() == "t"]
        signatures = tuple(value.strip() for key, _, value in items if key.strip() == "v1")
        if len(timestamps) != 1 or not signatures:
            raise unauthorized("bad_signature", "Stripe-Signature needs one t= and a v1= signature")
        _fresh(timestamps[0], self._cfg.tolerance_s, self._clock())
        return Signed(None, timestamps[0], signatures)

    def verify(self, signed: Signed, body: bytes) -> Verified:
        prefix = f"{signed.timestamp}.".encode()

        def expected(key: bytes) -> str:
            return hmac.digest(key, prefix + body, hashlib.sha256).hex()

        matched = _matching(self._secrets, signed.signatures, expected)
        if matched is None:
            return self._verified(None, "")
        return self._verified(matched, _event_id(body))


def _event_id(body: bytes) -> str:
    """The event's ``id``; an authentic body without one (never sent by
    Stripe) is keyed by its digest, and normalization judges the rest."""
    try:
        event = json.loads(body)
    except (ValueError, RecursionError):
        event = None
    event_id = event.get("id") if isinstance(event, dict) else None
    if isinstance(event_id, str) and _DELIVERY_ID.fullmatch(event_id):
        return event_id
    return "sha256-" + hashlib.sha256(body).hexdigest()


SCHEMES: Mapping[str, type[Scheme]] = {s.name: s for s in (StandardWebhooks, GitHub, Stripe)}


def scheme_for(
    cfg: WebhookConfig, secrets: Sequence[Secret], clock: Callable[[], float] = time.time
) -> Scheme:
    return SCHEMES[cfg.mode](cfg, secrets, clock)
