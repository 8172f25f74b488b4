"""The leader part: one agent plans for the job (`state`: its plain state; `step` and
`resume`: its decisions, pure; `shell`: the `Leader` object that campaigns, hosts the
rendezvous store, observes for the step and carries out its actions; `pull`: the holdings
pull, the I/O half of a resume)."""
