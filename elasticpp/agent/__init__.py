"""The node agent: supervises local workers, meets the other agents in etcd, and re-plans
and resumes training when nodes fail or join. It composes `plan`, `train` (worker entry
point), `store` and `cluster`; nothing below imports it.
"""
