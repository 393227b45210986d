"""``shmreplay.ray``: actors anywhere on a Ray cluster feed the replay on the learner's node.

Optional (``pip install "shmreplay[ray]"``), imported only when used.
Replay stays on the learner's box; remote producers cannot map its shared
memory, so they send chunks of rows through Ray's object store to an
*ingest* actor pinned to the daemon's node, which inserts them as an
ordinary local client.

    # on the replay node (where shmreplayd and the learner run), after ray.init():
    ingest = shmreplay.ray.start_ingest(socket_path, "replay")
    # in any Ray actor or task, on any node:
    w = shmreplay.ray.RemoteWriter(ingest, chunk=64, in_flight=2)
    w.insert(obs=o, action=a, reward=r)        # or insert_batch({...}, priorities)
    w.flush()                                   # every row so far is committed

* **Placement.**  ``start_ingest`` schedules the ingest with
  ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` on the node that
  calls it (or ``node_id=``): it must share /dev/shm with the daemon.
* **Zero copy on arrival.**  A chunk is a dict of numpy arrays; Ray stores
  large ones in the object store and the ingest reads them as read-only
  views of it, which ``insert_batch`` copies once, into the table's slots.
  A small one (up to 64 KiB) travels packed: its rows in one byte array,
  in the table's row layout (packing.py), which the ingest reads back as
  views: Ray pickles each array of a call apart, and one array instead of
  five cut a sac-mujoco chunk's serialization from 100 to 38 us.
* **Back-pressure.**  A writer keeps at most ``in_flight`` ingest calls
  unanswered; the next send waits for the oldest.  The ingest admits a
  chunk as the table's rate limiter admits its rows (``insert_batch``
  waits in the daemon), so a slow or rate-limited table holds remote
  producers back instead of growing memory anywhere: at most ``(in_flight
  + hold) x chunk`` rows per producer exist outside the table's
  vouched-for rows.
* **Confirmation, batched.**  A chunk is *confirmed* once its rows are
  committed and flushed (``Client.flush``: the daemon has applied every
  insert before it).  A flush costs about four times a small chunk's
  insert and wakes the daemon, so the ingest flushes once per
  ``flush_every`` chunks (16 by default, of all producers) and when a
  producer asks; its answers carry the sequence numbers flushed since.  A
  writer keeps each answered chunk until it is confirmed (at most
  ``hold``, 16 by default, of them; past that it asks), to send it again
  if the ingest or the daemon loses it: a producer keeps up to ``(in_flight
  + hold) x chunk`` rows in its own memory (a dqn-atari chunk of 64 rows is
  1.8 MB: ~32 MB).  ``w.flush()`` returning
  means every row inserted before it is confirmed.  An ingest call that
  fails for good (the table refused the rows, no ingest for ``retries``
  attempts) raises in the producer at its next send or ``flush``, as
  ``ChunkRefused`` naming why.
* **Small chunks, inserted together.**  On a table without a rate limiter,
  a chunk of at most 64 KiB (coalesce.py) is checked when it arrives and
  held; the held chunks go in as one ``insert_batch`` (per run of chunks
  with priorities given, or not) just before the flush, once they reach
  1 MiB, or ``hold_s`` (0.05 s) after the first came, by the ingest's own
  thread when no call comes: a quiet producer's rows are sampleable within
  about ``2 x hold_s`` plus the daemon's ``idle_timeout_s``.  For a 64-row
  sac-mujoco chunk this halves the ingest's and the daemon's work per
  chunk.  ``start_ingest(hold_s=0)`` inserts each chunk when it comes, as
  a rate-limited table's ingest always does.

Priorities, rate limits and reuse limits are the table's, exactly as for a
local writer: the ingest is one.

Failures (at-least-once: nothing confirmed is lost, nothing is torn):

* **The ingest dies** (its process, its node's raylet): Ray restarts it
  (``max_restarts``, default for ever) and it reconnects.  A chunk whose
  call failed with it is sent again, up to ``retries`` times with a
  growing pause; so is every chunk the dead ingest had answered but not
  confirmed (a new incarnation id in the next answer says so).  A chunk
  the dead ingest had flushed but not yet confirmed is then stored twice.
  A re-sent chunk may land after later chunks of the same producer.
* **The daemon restarts under the ingest**: its client reconnects
  (``reconnect=True``) and the restarted daemon adopts the tables; the
  ingest's next flush says inserts since the last one may be lost, and
  every chunk inserted since is sent again by its producer (told in its
  next answer; possibly stored twice); when the restart is met while
  inserting held chunks, the held batch that met the reconnect and those
  after it are kept, not sent again.
* **A producer dies**: the rows it had buffered or sent unconfirmed may be
  lost; chunks already sent are inserted whole or not at all by a live
  ingest, unless the daemon also fails part-way through their batch (a
  chunk on a rate-limited table is inserted as the limiter admits it;
  ``timeout`` bounds that).  What the ingest owed it (sequence
  numbers flushed after its last answer) is dropped once it has not called
  for ``forget_s`` (600 s); a producer that was only silent that long
  sends its unconfirmed chunks again at its next flush.
* **Anything else the table refuses** (a wrong field, a bad priority)
  raises ``ChunkRefused`` in the producer at once, naming why.

Trust (docs/reliability.md, section 13): an acknowledgement confirms a
chunk only when it comes from the ingest incarnation that answered it; a
producer's sequence numbers are kept by a secret key of 128 random bits
that only it holds (stats and ``RemoteWriter.id`` show a digest).  Ray
does not isolate the jobs of a cluster: every task runs as the cluster's
user and may call, kill or run code in the ingest, so run the cluster as a
member of the daemon's group (never root or the daemon's user: they may
drop tables), and leave the ingest unnamed, in the job's own namespace.

Who calls it: ``start_ingest`` a driver or actor on the replay node;
``RemoteWriter`` one thread of a producer (it is not thread-safe).

Its modules: ``ingest.py`` (the ingest actor) with ``inserter.py`` (its
table side: the client, the chunks written into the table),
``coalesce.py`` (small chunks held and inserted together) and ``producers.py``
(each producer's secret key and what the ingest owes it); ``writer.py`` (``RemoteWriter``) with ``packing.py`` (a
small chunk's wire form) and ``steps.py`` (the n-step and sequence
writers, remote); ``relay.py`` (a ``ParameterBoard`` read on the replay
node for remote actors).

Sharded tables (one table over several nodes' daemons, sampled as one
table of their union; docs/scaling.md): ``shardtable.py``
(``ShardedTable``) with ``shardbook.py`` (a learner's agents and what each
shard last reported), ``shardupdates.py`` (priority updates routed to
their shards), ``sharddraws.py`` (one batch over the shards) and
``shardmath.py`` (how a batch splits by priority mass, and the weights
against the global minimum); ``shardagent.py`` (a learner's client of one
shard, on its node); ``shardhost.py`` (a node's shard daemon and ingests:
``start_shards``); ``shardwriter.py`` (``ShardedWriter``: the local shard
first, else in turn).
"""

from .ingest import start_ingest
from .inserter import LEASE_KEEP_S
from .relay import start_parameter_relay
from .sharddraws import ShardBatch
from .shardhost import Shard, attach_shards, start_shards, stop_shards
from .shardtable import ShardedTable
from .shardwriter import ShardedWriter
from .steps import RemoteNStepWriter, RemoteSequenceWriter
from .writer import ChunkRefused, RemoteWriter

__all__ = ["ChunkRefused", "LEASE_KEEP_S", "RemoteNStepWriter", "RemoteSequenceWriter", "RemoteWriter",
           "Shard", "ShardBatch", "ShardedTable", "ShardedWriter", "attach_shards", "start_ingest",
           "start_parameter_relay", "start_shards", "stop_shards"]
