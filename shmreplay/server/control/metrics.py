"""Prometheus metrics at ``/metrics`` (``metrics_port``, ``--metrics-port``).

Served by ``prometheus_client``'s own HTTP server thread.  A scrape reads
the ``Monitor``'s latest snapshot (``monitor.py``, refreshed every second
on the event loop), so it asks the engine nothing and costs the data path
nothing; values are at most one monitor interval old.  Metrics, labelled
by ``table`` where they belong to one:

  shmreplay_table_items, shmreplay_table_capacity, shmreplay_table_bytes (gauges)
  shmreplay_inserts_total, shmreplay_samples_total (items),
  shmreplay_sample_calls_total (batches), shmreplay_priority_updates_total,
  shmreplay_evictions_total (counters)
  shmreplay_rate_limiter_waiting{table, kind="insert"|"sample"} (gauge:
      requests parked behind the limits now)
  shmreplay_sample_seconds (histogram: the engine's time per SAMPLE)
  shmreplay_checkpoint_last_success_timestamp_seconds (gauge; absent until one)
  shmreplay_clients, shmreplay_daemon_resident_bytes, shmreplay_up (gauges)

Who calls it: the daemon starts and stops it from the event loop;
``collect`` runs on the HTTP server's thread.
"""

from __future__ import annotations

import logging
import time

from ...errors import ReplayError

log = logging.getLogger("shmreplayd")

HIST_BASE_S = 1.024e-6  # engine/commands.py: bucket k holds SAMPLEs under HIST_BASE_S * 2**k


class Collector:
    def __init__(self, monitor, checkpoints, instance: str):
        self.monitor, self.checkpoints, self.instance = monitor, checkpoints, instance

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        latest = self.monitor.latest
        up = GaugeMetricFamily("shmreplay_up", "1 once the daemon has a snapshot of its tables")
        up.add_metric([], 0 if latest is None else 1)
        yield up
        if latest is None:
            return
        _, snap = latest
        tables = snap["tables"]
        label = ["table"]

        def gauge(name, doc, key):
            m = GaugeMetricFamily(name, doc, labels=label)
            for t, st in tables.items():
                m.add_metric([t], st[key])
            return m

        def counter(name, doc, key):
            m = CounterMetricFamily(name, doc, labels=label)
            for t, st in tables.items():
                m.add_metric([t], st[key])
            return m

        yield gauge("shmreplay_table_items", "Items in the table now", "size")
        yield gauge("shmreplay_table_capacity", "The table's capacity in items", "capacity")
        yield gauge("shmreplay_table_bytes", "Bytes of the table's rows (shared memory or file)", "rows_bytes")
        yield counter("shmreplay_inserts", "Items committed", "inserts")
        yield counter("shmreplay_samples", "Items sampled (a batch of n counts n)", "samples")
        yield counter("shmreplay_sample_calls", "SAMPLE requests answered (batches)", "sample_calls")
        yield counter("shmreplay_priority_updates", "Priorities updated", "priority_updates")
        yield counter("shmreplay_evictions", "Items evicted for writers", "evictions")
        waiting = GaugeMetricFamily("shmreplay_rate_limiter_waiting",
                                    "Requests parked behind the table's limits now", labels=["table", "kind"])
        for t, st in tables.items():
            waiting.add_metric([t, "insert"], st["limiter"]["waiting_inserts"])
            waiting.add_metric([t, "sample"], st["limiter"]["waiting_samples"])
        yield waiting
        hist = HistogramMetricFamily("shmreplay_sample_seconds", "The engine's time per SAMPLE",
                                     labels=label)
        for t, st in tables.items():
            h = st.get("sample_time")
            if h is None:
                continue
            counts, total, buckets = h["log2_us_buckets"], 0, []
            for k, c in enumerate(counts[:-1]):
                total += c
                buckets.append((repr(HIST_BASE_S * 2 ** k), total))
            buckets.append(("+Inf", total + counts[-1]))
            hist.add_metric([t], buckets, sum_value=h["sum_ns"] / 1e9)
        yield hist
        ck = GaugeMetricFamily("shmreplay_checkpoint_last_success_timestamp_seconds",
                               "Unix time of the table's last checkpoint written", labels=label)
        for t, at in dict(self.checkpoints.last_success).items():
            ck.add_metric([t], at)
        yield ck
        clients = GaugeMetricFamily("shmreplay_clients", "Clients attached")
        clients.add_metric([], snap["clients"])
        yield clients
        rss = GaugeMetricFamily("shmreplay_daemon_resident_bytes", "The daemon's resident memory")
        rss.add_metric([], snap.get("memory", {}).get("rss_bytes", 0))
        yield rss


class MetricsServer:
    """The HTTP endpoint; ``port`` 0 takes any free port (``self.port``)."""

    def __init__(self, address: str, port: int, monitor, checkpoints, instance: str):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise ReplayError("metrics_port is set but prometheus-client is not installed: "
                              "pip install 'shmreplay[metrics]' (or prometheus-client)") from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(monitor, checkpoints, instance))
        try:
            self.server, self.thread = start_http_server(port, address, registry=registry)
        except OSError as exc:  # no such address here, a name that does not resolve, a port in use
            # a config error names the key and what to write (docs/operations.md,
            # "The daemon does not start"), not a traceback from the socket module
            raise ReplayError(f"cannot serve metrics at metrics_address {address!r}, metrics_port {port}: "
                              f"{exc}; set metrics_address to an address of this host (default "
                              f"127.0.0.1) and metrics_port to a free port (0: any)") from None
        self.address, self.port = address, self.server.server_port
        log.info("metrics at http://%s:%d/metrics", address, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
