"""What every part of the agent uses and none owns: the executor of actions, the journal of
decisions, the error policy and the summaries the parts publish to each other."""
