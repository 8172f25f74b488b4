"""The follower part: this node's way through each generation (`step`: its phases decided,
pure; `shell`: the `Follower` object that observes for the step, writes its arrivals, fetches
the resume state and hands the ranks to warm workers)."""
