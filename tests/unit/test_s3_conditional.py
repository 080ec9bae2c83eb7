"""How the start-up probe reads a store's answers to a repeated conditional write
(``app.tiers.s3.conditional``): 412 honoured; accepted twice, or the header refused
(400, 501), not honoured; anything else is the probe's failure (retried later)."""

from __future__ import annotations

import botocore.exceptions as bce
import pytest

from app.tiers.s3.conditional import honours_if_none_match


@pytest.mark.parametrize(
    ("statuses", "honoured"),
    [
        ((None, 412), True),  # stored, then refused: honoured
        ((412,), True),  # the key existed already
        ((None, None), False),  # overwritten: ignored
        ((501,), False),  # the header refused
        ((400,), False),
    ],
)
def test_the_probe_reads_the_answers(statuses: tuple[int | None, ...], honoured: bool) -> None:
    calls: list[int] = []

    def write() -> None:
        status = statuses[len(calls)]
        calls.append(status or 200)
        if status is not None:
            raise _client_error(status)

    assert honours_if_none_match(write) is honoured


def test_any_other_refusal_is_the_probes_failure() -> None:
    def write() -> None:
        raise _client_error(403)

    with pytest.raises(bce.ClientError):
        honours_if_none_match(write)


def _client_error(status: int) -> bce.ClientError:
    code = {412: "PreconditionFailed", 501: "NotImplemented", 403: "AccessDenied"}
    return bce.ClientError(
        {
            "Error": {"Code": code.get(status, str(status)), "Message": ""},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "PutObject",
    )
