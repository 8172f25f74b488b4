"""The stop part: an operator's `elasticpp job stop`, from the request to the job's end
(`step`: pure; `shell`: the `JobStop` object)."""
