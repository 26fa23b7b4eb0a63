"""The Kafka topics of the contract: created once, the same way, by every part.

``ensure_topics`` creates the feedback and DLQ topics (partitions, replication,
``retention.ms``, ``cleanup.policy=delete``, ``segment.ms``) and brings the retention of
existing ones to the given value. The node's producer (retention: the longest tenant
TTL), the learner and the embedded stack (retention: the default TTL) all call it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from adaflash.config import GovernanceConfig, KafkaConfig, Settings

log = logging.getLogger("adaflash.topics")

MS_PER_DAY = 86_400_000


def default_retention_ms(gov: GovernanceConfig | None = None) -> int:
    """``retention.ms`` from the default tenant TTL (``governance.default_ttl_days``)."""
    return int((gov or GovernanceConfig()).default_ttl_days * MS_PER_DAY)


def _kafka_cfg(settings: Settings | KafkaConfig) -> KafkaConfig:
    return settings.kafka if isinstance(settings, Settings) else settings


def ensure_topics(bootstrap: str, settings: Settings | KafkaConfig, retention_ms: int,
                  *, topics: Iterable[str] | None = None, timeout_ms: int = 10_000,
                  update_existing: bool = True) -> dict[str, str]:
    """Create the feedback and DLQ topics (partitions, ``retention.ms``) if missing.

    With ``update_existing`` (the node's producer, which knows the tenants' TTLs),
    existing topics get their ``retention.ms`` altered to the given value (best effort:
    brokers that do not support AlterConfigs keep what they have); without it (learner,
    embedded stack) they are left as they are. Returns
    ``{topic: "created" | "exists" | "updated"}``.
    """
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    kc = _kafka_cfg(settings)
    names = list(topics) if topics is not None else [kc.feedback_topic, kc.dlq_topic]
    configs = {"retention.ms": str(int(retention_ms)), "cleanup.policy": "delete"}
    if kc.segment_ms:
        configs["segment.ms"] = str(int(min(kc.segment_ms, retention_ms)))
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=timeout_ms,
                             bootstrap_timeout_ms=timeout_ms, client_id="adaflash-topics")
    out: dict[str, str] = {}
    try:
        existing = set(admin.list_topics())
        missing = [n for n in names if n not in existing]
        for name in names:
            if name in existing:
                out[name] = "exists"
        if missing:
            new = [NewTopic(name=n, num_partitions=kc.partitions, replication_factor=kc.replication_factor,
                            topic_configs=dict(configs)) for n in missing]
            try:
                admin.create_topics(new, timeout_ms=timeout_ms)
                for n in missing:
                    out[n] = "created"
            except TopicAlreadyExistsError:
                for n in missing:
                    out[n] = "exists"
        to_update = [n for n, s in out.items() if s == "exists"] if update_existing else []
        if to_update:
            try:
                admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, n, configs=dict(configs))
                                     for n in to_update], raise_on_unknown=False)
                for n in to_update:
                    out[n] = "updated"
            except Exception as e:  # noqa: BLE001 - broker without AlterConfigs
                log.warning("could not alter topic configs (%s); keeping the broker's", type(e).__name__)
    finally:
        admin.close()
    return out
