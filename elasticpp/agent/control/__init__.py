"""The control part: status, drains, health and the end of the job (`step`: its pure
decisions; `shell`: the object that observes for them and applies their actions)."""
