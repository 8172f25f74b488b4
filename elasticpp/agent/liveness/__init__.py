"""The liveness part: suspicion confirmed by probe (`step`: the follower's watch on the
leader, pure; `shell`: the `Liveness` object that probes suspects on a bounded pool and
gives the verdicts)."""
