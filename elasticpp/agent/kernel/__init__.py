"""What every part of the agent uses and none owns: the executor of actions (`executor`),
the journal of decisions and the error policy (`journal`), the event log (`inbox`), the
summaries the parts publish to each other (`summaries`), their ports (`ports`), the clock
(`clock`), the limits (`limits`), the metrics (`metrics`), the worker pool (`pool`), the
per-assignment worker logs (`worklogs`), the pure rules of phases and worker states
(`decide`), typed JSON (`records`) and threads with futures (`threads`). It imports no
part (an import-linter contract)."""
