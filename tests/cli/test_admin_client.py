"""`zeroserve workers restart` waits for the real restart: drain, exit, a new process ready,
whichever gateway of `serve --gateways N` each poll reaches."""

from __future__ import annotations

import pytest

from zeroserve.cli.admin_client import AdminError, wait_restarted


def listing(status: str | None, incarnation: str = "old-process") -> list[dict]:
    """GET /admin/workers as one gateway answers it (status None: worker-1 not listed)."""
    if status is None:
        return []
    return [{"worker_id": "worker-1", "status": status, "pid": 7, "incarnation": incarnation}]


class ScriptedTier:
    """Answers each poll with the next listing (an AdminError is raised); the last repeats."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.num_polls = 0

    def workers(self) -> list[dict]:
        self.num_polls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, AdminError):
            raise answer
        return answer


def test_waits_past_the_old_process_on_every_gateway_until_a_new_one_is_ready():
    tier = ScriptedTier(
        listing("ready"),  # a gateway that has not seen the drain yet
        listing("draining"),
        AdminError("the gateway is busy"),
        listing(None),  # exited; the new process has not said HELLO here yet
        listing("ready"),  # another gateway that still lists the old process
        listing("ready", incarnation="new-process"),
    )
    wait_restarted(tier, "worker-1", "old-process", timeout_s=5, poll_s=0)
    assert tier.num_polls == 6


def test_a_worker_that_never_comes_back_times_out():
    tier = ScriptedTier(listing("draining"), listing(None))
    with pytest.raises(AdminError, match="not ready again within"):
        wait_restarted(tier, "worker-1", "old-process", timeout_s=0.05, poll_s=0.01)
