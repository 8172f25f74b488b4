"""Timeouts, intervals and limits of the agent, in one place (seconds unless named)."""

DEAD_RECHECK_S = 2.0  # how often a node is probed at most (also nodes confirmed dead)
PROBE_THREADS = 16  # the agent's pool for health probes of peers
# Live suspects of a failure that waits are probed again at most this many a second: an
# answer SERVING from a round of n probes is kept n / PROBE_RECHECK_PER_S when that is
# longer than DEAD_RECHECK_S (a 2,048-node job's suspects every ~20 s, not every 2 s).
PROBE_RECHECK_PER_S = 100.0
LEADER_SUSPECT_S = 0.3  # a failure left unanswered this long makes followers probe the leader
STOP_GRACE_S = 20.0  # a graceful stop that takes longer is turned into a kill
# A job stop (elasticpp job stop): how long an agent waits for its final checkpoint to be
# persisted before it says the stop is done without it (a shared file system that hangs),
# and how long the leader waits for the nodes that have not said so before it ends the job.
FINAL_PERSIST_S = 900.0
STOP_END_MARGIN_S = 60.0
# The leader waits this much longer than stop_timeout_s for a node's stopped-G: a node whose
# old workers outlive SIGKILL reports that itself, naming them, once its own stop_timeout_s
# has run (counted from its kill, which follows the leader's write of the generation).
STOPPED_WAIT_MARGIN_S = 5.0
MAX_REPLAN_BACKOFF_S = 10.0  # ceiling of the wait between failed generations
JOIN_TIMEOUT_S = 60.0  # how long a starting agent waits for etcd before giving up
GPU_CHECK_INTERVAL_S = 10.0  # NVML health poll, only with --device cuda
# The node's worker template is pinged this often between forks; one that does not answer
# within its answer timeout (WorkerTemplate.answer_timeout_s) is killed and replaced. A
# template that served and died is replaced no sooner than TEMPLATE_RESTART_MIN_S after its
# start (each start imports torch: one that dies at once is not restarted at every tick).
TEMPLATE_PING_EVERY_S = 2.0
TEMPLATE_RESTART_MIN_S = 30.0
# The agent process adopts the orphans of its tree (a child subreaper) and looks for the ones
# that exited this often. At its stop, what is left of its tree after its own shutdown has
# AGENT_STOP_GRACE_S after SIGTERM (and SIGCONT), then SIGKILL and AGENT_STOP_KILL_WAIT_S to
# go; a shutdown that is not over stop_timeout_s after the stop signal is cut short that way.
ORPHAN_SCAN_EVERY_S = 1.0
AGENT_STOP_GRACE_S = 2.0
AGENT_STOP_KILL_WAIT_S = 3.0
LOOP_STALL_S = 10.0  # health turns NOT_SERVING when the loop has been in one tick this long
LOOP_WATCH_S = 2.0  # how often the watchdog looks at the loop's heartbeat (a wake-up each)
# The node's membership and leader leases are not renewed while the decision loop has been in
# one tick this long (its waits for work do not count): they lapse a TTL later and the job
# goes on without the wedged node. Above a tick's usual worst case (a worker kill waits up
# to 10 s only for a process in D state).
LEASE_STALL_S = 5.0
EVENT_STREAMS = 4  # concurrent `ctl events` streams per agent
FETCH_STREAMS = 16  # concurrent piece transfers served per agent
FETCH_PER_SOURCE = 4  # concurrent piece transfers a resume asks of one source
FETCH_PARALLEL = 16  # concurrent piece transfers of one resume, all sources together
FETCH_STALL_S = 30.0  # a resume's transfers with no bytes this long fail (MOVING resumes its clock)
FETCH_MIN_BYTES_PER_S = 1 << 20  # slower than this over FETCH_STALL_S: a trickle, failed
# The leader's pull of holdings detail at a transition: nodes asked at once, the time one node
# gets, and the time the whole pull gets (2,048 nodes list one step each in ~2 s).
PULL_PARALLEL = 32
PULL_NODE_TIMEOUT_S = 5.0
PULL_DEADLINE_S = 30.0
UNARY_THREADS = 8  # server threads kept for health, status, drain and ListSteps
WORKER_LOGS_KEPT = 32  # newest worker log files kept in <state_dir>/logs
METRICS_ROTATE_BYTES = 64 << 20  # metrics.jsonl is rotated (one old file kept) past this
STATUS_EVERY_S = 0.2  # how often the loop publishes the status snapshot the RPCs read
# The decision loop runs when something wakes it (a watch event, a worker's event, a thread's
# result, an RPC) and otherwise every BUSY_TICK_S while it polls (training, leading, a failure
# of its own unanswered, a drain, etcd unreachable), every QUIET_TICK_S as a follower whose
# workers are silent: its phases move on events and its deadlines are tens of seconds long,
# so a quiet tick is a safety net (a deadline checked up to QUIET_TICK_S late). An idle
# follower's tick costs ~0.5 ms: at 1 s, 2,048 simulated nodes spent a core on ticks that
# found nothing. The watchdog and the lease gate count only time spent inside a tick
# (`clock.LoopHeartbeat`), so a long quiet wait stalls nothing.
BUSY_TICK_S = 0.05
QUIET_TICK_S = 5.0
# A follower at rest (its ranks running, or none planned here, its workers silent, its spares
# all ready, nothing pending: a spare node, the simulated nodes of bench/scale.py) sleeps up
# to this long when nothing wakes it, never past its supervisor's next deadline (a running
# worker's hang deadline, the next GPU check). Its quiet ticks were half of what an idle
# simulated node cost at 2,048 nodes (0.14 ms of CPU a second a node, 0.3 of a core).
RESTING_TICK_S = 30.0
# While its workers train (and nothing else is in motion) a node, leader or follower, ticks
# at this pace: every worker event, finished commit, replication round and watch event wakes
# the loop anyway, and what polls (the safe step every SAFE_EVERY_S, the status every
# STATUS_EVERY_S, hang deadlines of seconds) needs no more. At BUSY_TICK_S an agent's ticks
# took 2-2.5 % of a core for the whole of a training job: on a 2-core machine with 2 workers
# that was most of the agent's tax on a step.
TRAINING_TICK_S = 0.25
# A leader's turn reads every member, arrival and holding it plans with: ~5-10 ms of CPU at
# 2,048 nodes. Woken by every arrival of a transition, it took a turn per arrival or two and
# spent 9-18 s of a core on one transition (the simulation, with each node's etcd round trip
# its own). After a turn of c seconds of CPU, a leader's loop takes its next turn no sooner
# than c * (1 / LEADER_TURN_SHARE - 1) later (at most LEADER_TURN_GAP_MAX_S), a wake included:
# what came meanwhile is taken in one turn. ~1 ms at 4 nodes, ~25 ms at 2,048.
LEADER_TURN_SHARE = 0.25
LEADER_TURN_GAP_MAX_S = 0.2
# The view reads the job's cache at least this often (a tick's worth below QUIET_TICK_S, so a
# quiet tick refreshes it), and at once on a watch event but a member's change on a follower.
VIEW_REFRESH_S = QUIET_TICK_S - BUSY_TICK_S
# The leader compacts etcd's history this often, to the revision it read the time before: the
# history (a commit record per node per second, every transition's barriers) stays bounded.
COMPACT_EVERY_S = 300.0
SAFE_EVERY_S = 0.5  # how often the leader computes the safe step and every agent reads it
# The node's commit record is put at most this often, and only when it changed (by one writer
# thread, the newest value): one write per node per 5 s in steady state, 410 puts/s at 2,048
# nodes; sooner at fast steps, once half of the anchors a store keeps above the safe step are
# newer than the record (durability.anchors_ran_ahead). The leader's safe step lags a commit
# by up to this much more (plus SAFE_EVERY_S twice); the loop never waits for etcd.
COMMIT_RECORD_EVERY_S = 5.0
FENCED_SNAPSHOTS_KEPT = 3  # uncommitted steps kept on disk while this node is fenced
