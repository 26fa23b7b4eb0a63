"""The learner rides out its broker: connection resets, and a broker that comes back empty.

A connection reset needs nothing but patience: kafka-python reconnects, the DLQ flush
re-sends what the broker did not acknowledge (``FeedbackConsumer.flush_dlq``), a refused
offset commit is committed with the next checkpoint.

A broker restarted empty (Tansu's memory storage; an Apache Kafka cluster rebuilt) forgets
topics, offsets and the group, so the learner's positions point past the end of the new
topics and a fetch there returns nothing, for ever. ``BrokerWatch`` notices it from the
topic's id in the cluster metadata (a topic created again gets a new id), re-creates the
topics when they are missing, and then the learner starts a new *epoch*: it reads every
partition again from offset 0, records still held from the old epoch are trained (nobody
can read them again) but no longer hold back offset commits, and records revoked from it
in the rebalance the restart caused come back into its buffer. Records already trained
are recognised by their record_id in the checkpoint; records re-sent by producers after the
restart likewise. The group's rejoin after the restart can complete after that seek and would
resume from offsets committed to the new broker before the reset was noticed (positions in
the old log); so in a new epoch a partition the learner has not read from yet is sought to
offset 0 when it is assigned (``Learner._assigned``).

A rejoin can also finish half done: kafka-python 3.0 drives the group's join from the
learner's short polls, and a poll that times out just after the join completed cancels it
before the new assignment is applied. The member then counts itself stable, nothing asks
for another rejoin, and it keeps fetching its old partitions only (after a restart where a
producer re-created the topic with the broker's default partition count, the records on
the new partitions are never read). ``BrokerWatch`` notices a revocation that no
assignment followed while the group says it is stable, and asks for a rejoin.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("adaflash.learner")

CHECK_EVERY_S = 1.0  # how often the cluster metadata is looked at (no request: the client's cache)
ENSURE_EVERY_S = 2.0  # how often missing topics are created again
LIMBO_S = 120.0  # records revoked this recently come back if the broker turns out to have been reset
STUCK_JOIN_S = 10.0  # a stable group with a revocation still unanswered this long: rejoin


class BrokerWatch:
    def __init__(self, learner, monotonic=time.monotonic):
        self.learner = learner
        self.topic_id = None
        self._clock = monotonic
        self._last_check = 0.0
        self._last_ensure = 0.0
        self._limbo: list[tuple[float, object]] = []  # (revoked at, Item)
        self._unanswered_since: float | None = None  # stable group, revoked partitions never assigned

    def revoked(self, items: list) -> None:
        now = self._clock()
        self._limbo = [(t, i) for t, i in self._limbo if now - t < LIMBO_S] + [(now, i) for i in items]

    def take_limbo(self) -> list:
        now = self._clock()
        items = [i for t, i in self._limbo if now - t < LIMBO_S]
        self._limbo = []
        return items

    def tick(self) -> None:
        now = self._clock()
        if now - self._last_check < CHECK_EVERY_S:
            return
        self._last_check = now
        self._check_join(now)
        consumer = self.learner.consumer
        cluster = consumer.consumer._client.cluster
        tid = cluster.topic_id(consumer.topic)
        if tid is None:
            self._ensure_topics(now, cluster)
            return
        if self.topic_id is None:
            self.topic_id = tid
        elif tid != self.topic_id:
            log.warning("feedback topic %s has a new id (%s, was %s): the broker came back empty",
                        consumer.topic, tid, self.topic_id)
            self.topic_id = tid
            self.learner.on_broker_reset()

    def _ensure_topics(self, now: float, cluster) -> None:
        if now - self._last_ensure < ENSURE_EVERY_S:
            return
        self._last_ensure = now
        try:
            self.learner.ensure_topics()
        except Exception as e:  # noqa: BLE001 - broker still down: try again later
            log.warning("cannot create the topics yet: %s", type(e).__name__)
        cluster.request_update()

    def _check_join(self, now: float) -> None:
        """Ask for a rejoin when the group calls itself stable but the revocation that began
        the last rebalance was never followed by an assignment (a join cut off half done)."""
        from kafka.structs import MemberState

        coordinator = self.learner.consumer.consumer._coordinator
        if (not self.learner.suspended_parts or coordinator.need_rejoin()
                or coordinator.state is not MemberState.STABLE):
            self._unanswered_since = None
            return
        if self._unanswered_since is None:
            self._unanswered_since = now
        elif now - self._unanswered_since >= STUCK_JOIN_S:
            log.warning("the group is stable but partitions %s were revoked and no assignment followed "
                        "for %.0f s: rejoining", sorted(self.learner.suspended_parts), now - self._unanswered_since)
            self._unanswered_since = None
            coordinator.request_rejoin()
