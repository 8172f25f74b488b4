"""The durability part: what the workers hand over becomes committed state (`step`: a
worker's steps and snapshots decided, pure; `shell`: the `Durability` object that records,
commits, writes the commit records, replicates and persists)."""
