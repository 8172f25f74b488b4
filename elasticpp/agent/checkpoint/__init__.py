"""The checkpoint part: an operator's `elasticpp job checkpoint`, a persistent checkpoint now
(`step`: pure; `shell`: the `JobCheckpoint` object)."""
