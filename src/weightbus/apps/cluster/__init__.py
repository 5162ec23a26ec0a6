"""A cluster on one machine (network namespaces on a switch, links rate-limited with `tbf`),
shared by `weightbus bench cluster` and the tests: `hosts` makes and tears it down, `linkrate`
measures what a link carries."""

from weightbus.apps.cluster.hosts import Cluster, Host, start_cluster, unavailable

__all__ = ["Cluster", "Host", "start_cluster", "unavailable"]
