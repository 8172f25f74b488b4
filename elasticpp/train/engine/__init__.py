"""One rank's training engine: the trainer and its step (`trainer`), process groups
(`parallel`), pipeline sends (`p2p`), schedules (`schedule`), gradient buckets (`buckets`),
kernels (`kernels`) and the step profiler (`profiler`). Import each name from its module."""
