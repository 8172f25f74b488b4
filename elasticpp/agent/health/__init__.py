"""The health part: quarantines and the job's end (`step`: the end of the job decided, pure;
`shell`: the `Health` object that reads and writes their etcd records and carries out the
leader's health decisions)."""
