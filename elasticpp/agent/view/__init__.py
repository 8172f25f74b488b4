"""The view part: what this agent knows of the job's etcd state (`step`: how a read becomes
what it knows, pure; `shell`: the `View` object that reads, and what it publishes)."""
