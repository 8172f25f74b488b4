"""The etcd flags every command that reaches etcd takes (`agent`, `job`): endpoints, the
job's key prefix, TLS, a client certificate, a user and a password file."""

from __future__ import annotations

import argparse

from elasticpp.cli import flagtypes
from elasticpp.cluster.etcd.security import EtcdSecurity, parse_endpoint
from elasticpp.cluster.keys import ROOT, check_prefix
from elasticpp.errors import ConfigError


def add_etcd_flags(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument(
        "--etcd",
        type=flagtypes.etcd_endpoints,
        required=required,
        default=None,
        help="etcd endpoints, HOST:PORT[,HOST:PORT...] (https://HOST:PORT with --etcd-ca)",
    )
    p.add_argument(
        "--etcd-prefix",
        type=flagtypes.etcd_prefix,
        default=ROOT,
        help="where the job's etcd keys live: PREFIX/<job name>/ (an etcd role grants that)",
    )
    etcd = p.add_argument_group("etcd security (docs/deploy.md, 'Securing a job')")
    path = flagtypes.path
    etcd.add_argument("--etcd-ca", type=path, default=None, help="CA file: speak TLS to etcd")
    etcd.add_argument("--etcd-cert", type=path, default=None, help="client certificate file")
    etcd.add_argument("--etcd-key", type=path, default=None, help="its private key file")
    etcd.add_argument(
        "--etcd-user", type=flagtypes.nonempty, default=None, help="etcd user (needs TLS)"
    )
    etcd.add_argument(
        "--etcd-password-file",
        type=path,
        default=None,
        help="file holding the etcd user's password (a systemd credential, a Secret)",
    )


def etcd_from_args(args: argparse.Namespace) -> tuple[tuple[str, ...], EtcdSecurity | None]:
    """The endpoints and the security settings the flags give, each checked (ConfigError
    naming a bad one); the password read from its file."""
    check_prefix(args.etcd_prefix)
    if args.etcd is None:
        raise ConfigError("--etcd (or ELASTICPP_ETCD) is needed: the etcd endpoints")
    endpoints = tuple(e.strip() for e in args.etcd.split(",") if e.strip())
    if not endpoints:
        raise ConfigError("--etcd needs at least one HOST:PORT")
    security = EtcdSecurity.from_files(
        ca_file=args.etcd_ca,
        cert_file=args.etcd_cert,
        key_file=args.etcd_key,
        user=args.etcd_user,
        password_file=args.etcd_password_file,
    )
    for endpoint in endpoints:
        parse_endpoint(endpoint, tls=security is not None and security.tls)  # names a bad one
    return endpoints, security
