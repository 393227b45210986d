"""Issue 24, item 4: Prometheus metrics of a real daemon, scraped over real
HTTP and read with prometheus_client's own parser."""

import threading
import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import shmreplay  # noqa: E402
from waiting import HANG_S, wait_for  # noqa: E402

FIELDS = {"x": ("float32", (4,))}


def scrape(url: str) -> dict:
    """{(name, labels as a sorted tuple): value} of one scrape."""
    body = urllib.request.urlopen(url, timeout=HANG_S).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_follow_the_tables(start_daemon, tmp_path):
    d = start_daemon(metrics_port=0, checkpoint_dir=str(tmp_path / "ck"))
    with d.connect() as c:
        url = c.stats()["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        t = c.create_table("replay", 1000, FIELDS)
        q = c.create_queue("q", 16, FIELDS)
        t.insert_batch({"x": np.ones((300, 4))})
        c.flush()
        b = t.sample(32)
        t.update_priorities(b.keys, np.full(32, 2.0))
        c.checkpoint(str(tmp_path / "ck"), "replay")
        # a learner parked on the empty queue: the limiter's waiting gauge
        parked = threading.Thread(target=lambda: _sample_quietly(d, "q"), daemon=True)
        parked.start()
        tbl = (("table", "replay"),)
        want = {("shmreplay_table_items", tbl): 300, ("shmreplay_table_capacity", tbl): 1000,
                ("shmreplay_table_bytes", tbl): c.stats()["tables"]["replay"]["rows_bytes"],
                ("shmreplay_inserts_total", tbl): 300,
                ("shmreplay_samples_total", tbl): 32, ("shmreplay_sample_calls_total", tbl): 1,
                ("shmreplay_priority_updates_total", tbl): 32,
                ("shmreplay_rate_limiter_waiting", (("kind", "sample"), ("table", "q"))): 1,
                ("shmreplay_sample_seconds_count", tbl): 1}
        got = {}

        def caught_up():  # the endpoint shows the monitor's last snapshot (1 s old at most)
            got.update(scrape(url))
            return all(got.get(k) == v for k, v in want.items())
        wait_for(caught_up, f"the metrics to show {want}")
        assert got[("shmreplay_clients", ())] >= 2
        assert got[("shmreplay_up", ())] == 1
        assert got[("shmreplay_daemon_resident_bytes", ())] > 0
        assert got[("shmreplay_checkpoint_last_success_timestamp_seconds", tbl)] > 0
        assert got[("shmreplay_sample_seconds_bucket", (("le", "+Inf"),) + tbl)] == 1
        assert 0 < got[("shmreplay_sample_seconds_sum", tbl)] < 60
        q.insert(x=np.ones(4))   # the parked learner takes it and leaves
        c.flush()
        parked.join(HANG_S)
        assert not parked.is_alive()


def _sample_quietly(d, name):
    with d.connect() as c:
        c.table(name).sample(1, timeout=HANG_S)


def test_metrics_are_off_unless_asked_for_and_a_bad_port_is_refused(start_daemon, tmp_path):
    d = start_daemon()
    with d.connect() as c:
        assert c.stats()["metrics"] is None
    from conftest import write_config
    import subprocess
    import sys
    cfg = write_config(tmp_path / "bad.toml", instance="x", metrics_port=70000)
    p = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", cfg],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "metrics_port must be an int in 0..65535" in p.stderr
