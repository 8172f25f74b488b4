"""The worker process and its supervisor's side of the protocol: the process itself
(`main`: `python -m elasticpp.train.worker.main`), the assignment it is given
(`assignment`), starting and watching it (`procs`, `launch`), the worker template it is
forked from (`forkserver`) and its snapshots (`snapshots`, `hostcopy`). This package
imports nothing: the agent imports these modules without loading torch."""
