"""The supervisor part: the node's worker processes (`step`: its deadlines, pure; `shell`:
the `Supervisor` object that spawns, watches and replaces the workers and their template)."""
