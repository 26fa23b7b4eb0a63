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
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("adaflash.learner")

CHECK_EVERY_S = 1.0  # how often the cluster metadata is looked at (no request: the client's cache)
ENSURE_EVERY_S = 2.0  # how often missing topics are created again
LIMBO_S = 120.0  # records revoked this recently come back if the broker turns out to have been reset


class BrokerWatch:
    def __init__(self, learner, monotonic=time.monotonic):
        self.learner = learner
        self.topic_id = None
        self._clock = monotonic
        self._last_check = 0.0
        self._last_ensure = 0.0
        self._limbo: list[tuple[float, object]] = []  # (revoked at, Item)

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
