"""The shipped IAM policies (``ops/iam/``) as written, enforced by the
emulator's IAM (moto evaluates a user's policies once its first actions,
the set-up's, are spent): the pipeline runs under them, the ingester's user
is refused a delete and the acker's a receive. moto differs from AWS in
two ways, each said where it is met: it authorizes a batch call by its
own name (``as_moto_reads``), and it authorizes
``GetQueueUrl`` against ``*``, not the queue, so the adapters name their
queue by URL here (AWS itself grants it on the queue's ARN)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from backhalf.records import AckClaim
from ingest.adapters.factory import make_acknowledger, make_adapter
from ingest.config import Settings
from ingest.embedded.sqs_server import SqsServer
from ingest.errors import AckError, BrokerError
from ingest.observe.dependency import refused_login
from ingest.processes.ack.acker import run_acker
from ingest.processes.pull.ingester import run_ingester
from tests.support.db import query, scalar
from tests.support.in_process import settings, wait_until
from tests.support.sqs import counts, create_queue, owned_sqs, send

POLICIES = Path(__file__).parents[3] / "ops" / "iam"
REGION = "eu-west-1"  # the policies' region and moto's account: written for it
# Actions moto serves without authentication before it starts checking:
# more than the set-up takes; the rest are spent before the test proper.
FREE_ACTIONS = 40
ROLES = {"ingester": "sqs-ingester-policy.json", "acker": "sqs-acker-policy.json"}


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()


@pytest.fixture
def iam_sqs(monkeypatch: pytest.MonkeyPatch) -> Iterator[SqsServer]:
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", str(FREE_ACTIONS))
    with owned_sqs() as server:
        monkeypatch.delenv("INITIAL_NO_AUTH_ACTION_COUNT")
        yield server


def _session(key_id: str, secret: str) -> Any:
    import boto3

    return boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name=REGION)


# AWS authorizes a batch call by its single action's name (there is no
# sqs:DeleteMessageBatch in IAM); moto checks the batch call's own name.
MOTO_BATCH_NAMES = {
    "sqs:DeleteMessage": "sqs:DeleteMessageBatch",
    "sqs:ChangeMessageVisibility": "sqs:ChangeMessageVisibilityBatch",
}


def as_moto_reads(policy: str) -> str:
    """The shipped policy, its actions as written, plus moto's names of the
    batch calls those actions allow on AWS."""
    document = json.loads((POLICIES / policy).read_text())
    for statement in document["Statement"]:
        actions = statement["Action"]
        statement["Action"] = actions + [MOTO_BATCH_NAMES[a] for a in actions if a in MOTO_BATCH_NAMES]
    return json.dumps(document)


def _set_up(endpoint: str) -> tuple[str, dict[str, dict[str, str]]]:
    """The queue ``orders`` with its dead-letter queue, five messages, and a
    user per role with its shipped policy; then IAM enforced."""
    admin = _session("AKIAADMINADMINADMIN0", "not-checked-yet")
    sqs = admin.client("sqs", endpoint_url=endpoint)
    url = create_queue(sqs, "orders", max_receive_count=15)
    send(sqs, url, [json.dumps({"n": i}).encode() for i in range(5)])
    iam = admin.client("iam", endpoint_url=endpoint)
    keys: dict[str, dict[str, str]] = {}
    for user, policy in ROLES.items():
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName=policy, PolicyDocument=as_moto_reads(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
    # Spend what is left of the free actions: from here every call is checked.
    for _ in range(FREE_ACTIONS):
        try:
            admin.client("sqs", endpoint_url=endpoint).list_queues()
        except ClientError:
            return url, keys
    raise AssertionError("the emulator never started checking credentials")


def _as(monkeypatch: pytest.MonkeyPatch, credentials: dict[str, str]) -> None:
    for name, value in {**credentials, "AWS_SESSION_TOKEN": "", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)


@contextlib.asynccontextmanager
async def running(process: Any, s: Settings) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(process(s, stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def test_the_shipped_policies_run_the_pipeline_and_refuse_the_other_side(
    db_url: str, redis_url: str, iam_sqs: SqsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, keys = await asyncio.to_thread(_set_up, iam_sqs.url)
    table = {"name": "orders", "transport": "sqs", "source": url, "region": REGION, "consumer": "c1"}
    s = settings(db_url, redis_url, table)
    (cfg,) = s.adapters
    probe = _session(
        key_id=keys["ingester"]["AWS_ACCESS_KEY_ID"], secret=keys["ingester"]["AWS_SECRET_ACCESS_KEY"]
    )
    figures = probe.client("sqs", endpoint_url=iam_sqs.url)

    # The ingester's user stores every message, and may not delete one.
    _as(monkeypatch, keys["ingester"])
    async with running(run_ingester, s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 5)
    (handle,) = query(db_url, "SELECT ack_entry_id FROM inbox ORDER BY id LIMIT 1")[0]
    deleter = make_acknowledger(cfg)
    try:
        # A call refused whole: an error the acker backs off on, and a
        # refused login its health says at once (issue 44), not an ack
        # refused one by one.
        with pytest.raises(AckError, match="AccessDenied") as raised:
            await deleter.ack([AckClaim(1, "orders", "sqsdel", "orders", None, handle, 1, None)])
    finally:
        await deleter.close()
    assert refused_login(raised.value)
    assert counts(figures, url)[:2] == (0, 5)  # all five in flight, none deleted

    # The acker's user deletes them, and may not receive.
    _as(monkeypatch, keys["acker"])
    adapter = make_adapter(cfg, ledger=None)
    with pytest.raises(BrokerError, match=r"AccessDenied|not authorized"):
        await adapter.start()
    await adapter.close()
    async with running(run_acker, s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 5)
    assert counts(figures, url) == (0, 0, 0)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 5
