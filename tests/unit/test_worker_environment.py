"""What a worker inherits of its agent's environment (supervisor.step.worker_environment):
the user's variables, not the agent's credentials or its own configuration."""

from __future__ import annotations

from elasticpp.agent.supervisor.step import worker_environment


def test_a_worker_gets_the_users_variables_and_not_the_agents() -> None:
    agent = {
        "PATH": "/usr/bin",
        "HF_TOKEN": "users-own-token",
        "CREDENTIALS_DIRECTORY": "/run/credentials/elasticpp-agent.service",
        "ELASTICPP_ETCD": "https://etcd:2379",
        "ELASTICPP_TOKEN_FILE": "/etc/elasticpp/token",
        "ELASTICPP_ETCD_PASSWORD_FILE": "/etc/elasticpp/etcd-password",
        "ELASTICPP_DEVICE": "cuda",
        "ELASTICPP_PROFILE_DIR": "/tmp/profiles",  # read by the worker itself
    }
    assert worker_environment(agent) == {
        "PATH": "/usr/bin",
        "HF_TOKEN": "users-own-token",
        "ELASTICPP_PROFILE_DIR": "/tmp/profiles",
    }
