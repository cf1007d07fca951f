"""The machine as a kernel on a books service sees it: every claim, asked for apart.

A kernel's connection to the service is the lifeline of its claims, and
carries only their news. What the whole machine looks like (for ``%claims``,
a claim's place in the queue, who holds what a claim waits for) is sized by
other users' claims, so it is asked for on a connection of its own, which
whatever comes back cannot break. Mixed into
:class:`~fluksio_nb.machine.client.ServiceQueue`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fluksio_nb.books import Allocation
from fluksio_nb.errors import ServiceUnavailable
from fluksio_nb.machine.connection import ServiceAt, ask_once
from fluksio_nb.queue import Ticket, timeout_message
from fluksio_nb.resources import Resources

if TYPE_CHECKING:
    from pathlib import Path


class Seen:
    """Snapshots of the service's books, and what a waiting claim reads from them."""

    path: Path
    at: ServiceAt
    user: str
    enforcement: dict[str, Any]

    def snapshot(self) -> dict[str, Any]:
        try:
            answer = ask_once(self.path, {"op": "snapshot"}, owner=self.at.owner)
        except ServiceUnavailable:
            raise  # says what is wrong already
        except (OSError, ValueError) as error:
            raise ServiceUnavailable(
                f"the books service at {self.path} did not give the machine: {error}"
            ) from None
        if answer["op"] != "snapshot":
            raise ServiceUnavailable(answer.get("message") or f"the books service said {answer}")
        return {
            **answer["snapshot"],
            "user": self.user,
            "books": "machine" if self.at.owner == 0 else "user",
            "enforcement": self.enforcement,
        }

    def position(self, ticket: Ticket) -> int | None:
        for claim in self.snapshot()["waiting"]:
            if claim["ticket"] == ticket.number:
                return claim["position"]
        return None

    def holders(self) -> list[Ticket]:
        holders = []
        for claim in self.snapshot()["running"]:
            held = claim["allocation"]
            holders.append(
                Ticket(
                    number=claim["ticket"],
                    resources=Resources(cpus=max(1, held["cpus"]), gpus=len(held["gpus"])),
                    label=claim["label"] or f"a claim of {claim['user']}",
                    since=claim["since"],
                    pid=claim["pid"],
                    state="running",
                    allocation=Allocation.from_dict(held),
                )
            )
        return holders

    def timeout_message(self, ticket: Ticket, timeout: float | None) -> str:
        return timeout_message(ticket, timeout, self.holders())
