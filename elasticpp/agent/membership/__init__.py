"""This node as a member of its job: the spec checked against the stored one, the job's
epoch, the registration (its lease, its member record), the version and node-id rules."""
