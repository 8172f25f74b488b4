"""Training data: samples addressed by global index (`samples`) and token files
(`tokenfiles`). Import each name from its module."""
