"""Loading the daemon's configuration: a bad value is refused when the file is read,
with an error naming the key, never accepted to fail later."""

import pytest

from hicache.config import DaemonConfig
from hicache.errors import InvalidArgument


@pytest.mark.parametrize("dotted, value", [
    ("tiers.eviction", "LRU"),  # accepted, then every engine's registration failed
    ("tiers.io_threads", 0),  # accepted, then every registration an INTERNAL error
    ("tiers.copy_threads", 0),
    ("metrics.port", 70000),  # accepted, then a traceback from the HTTP server's bind
    ("metrics.port", -1),
    ("server.socket_mode", 0o10660),  # not permission bits
    ("server.socket_mode", -1),
    ("sharing.disabled_extra_keys", [1, 2]),  # accepted, then no extra key (a string) ever matched
    ("sharing.disabled_extra_keys", ["secret", None]),
    ("server.max_pool_pages", 0),
    ("server.max_pool_pages", (1 << 31) + 1),  # page ids are int32
])
def test_a_value_that_would_fail_later_is_refused_at_load(dotted, value):
    section, _, key = dotted.partition(".")
    with pytest.raises(InvalidArgument, match=key):
        DaemonConfig.load(overrides={dotted: value})


def test_the_defaults_and_the_edges_load():
    DaemonConfig.load(overrides={"tiers.eviction": "lfu", "tiers.io_threads": 1, "tiers.copy_threads": 1,
                                 "metrics.port": 0, "server.socket_mode": 0o600,
                                 "sharing.disabled_extra_keys": ["secret", ""]})


@pytest.mark.parametrize("dotted, value", [
    ("server.drain_timeout_s", float("inf")),  # the drain then died asking systemd for inf + 30 s
    ("server.lease_s", float("nan")),  # no comparison with nan holds: a lease that never ends
    ("host.ratio", float("nan")),
    ("tiers.prefetch_timeout_s", float("nan")),
    ("remote.retry_s", float("inf")),
])
def test_a_number_that_is_not_finite_is_refused(dotted, value):
    section, _, key = dotted.partition(".")
    with pytest.raises(InvalidArgument, match=key):
        DaemonConfig.load(overrides={dotted: value})
    with pytest.raises(InvalidArgument, match="requests_per_s"):
        DaemonConfig.from_dict({"auth": {"identities": [{"name": "a", "requests_per_s": value}]}})


def test_toml_nan_and_inf_are_refused(tmp_path):
    path = tmp_path / "hicache.toml"
    path.write_text("[server]\ndrain_timeout_s = inf\n")
    with pytest.raises(InvalidArgument, match="drain_timeout_s"):
        DaemonConfig.load(path)
