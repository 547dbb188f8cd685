"""A tier on a Redis Cluster (redis+cluster:// URLs, a prefix with a hash tag): every
key in one slot, it serves through that slot's master, found from any node, and goes on
after that master dies and the cluster promotes its replica, and after a resharding
moves its slot to another master. A prefix without a hash tag is a usage error."""

from __future__ import annotations

import pytest

from pipeline.redis_cluster import ClusterUrl, cluster_url, tier_slot
from tests.redis_ha import Cluster, serves_through_failover, tier_prefix, usage_error


def test_a_cluster_url_names_its_nodes_and_a_tier_needs_a_hash_tag():
    assert cluster_url("redis+cluster://u:pw@10.0.0.1:7000,h:7001") == ClusterUrl(
        [("10.0.0.1", 7000), ("h", 7001)], "u", "pw")
    assert cluster_url("redis://h:6379/0") is None
    for wrong in ("redis+cluster://h", "redis+cluster://h:7000/1"):
        with pytest.raises(ValueError):
            cluster_url(wrong)
    assert tier_slot("{pipeline}") == tier_slot("{pipeline}-other")  # the tag alone counts
    with pytest.raises(ValueError):
        tier_slot("pipeline")
    assert "hash" in usage_error("status", "--redis-url", "redis+cluster://127.0.0.1:1",
                                 "--prefix", "pipeline")


@pytest.fixture
def cluster(tmp_path):
    with Cluster(tmp_path) as found:
        yield found


def test_a_tier_on_a_cluster_serves_on_after_its_slots_master_fails_over(cluster, model_files,
                                                                        tmp_path):
    prefix = tier_prefix(tagged=True)

    def fail_over() -> None:
        old = cluster.master_of(prefix)
        assert cluster.fail_over(prefix) != old

    serves_through_failover(cluster.url, prefix, tmp_path, fail_over)


def test_a_tier_on_a_cluster_serves_on_through_its_slots_migration(model_files, tmp_path):
    """A resharding moves the tier's slot, keys and all, to another master: a read
    blocked on a stream that moved away is unblocked (UNBLOCKED, a rejoin, not a
    crash), and a MOVED that one connection gets sends the others to the new master."""
    prefix = tier_prefix(tagged=True)
    with Cluster(tmp_path, replicas=0) as cluster:
        def migrate() -> None:
            old = cluster.master_of(prefix)
            assert cluster.migrate(prefix) != old and cluster.master_of(prefix) != old

        serves_through_failover(cluster.url, prefix, tmp_path, migrate)
