"""Load the client's private key (OpenSSH or PEM; Ed25519, ECDSA or RSA) without ever leaking it in errors."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import paramiko

from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.ssh.config import SSHNodeConfig


def load_private_key(cfg: SSHNodeConfig) -> paramiko.PKey:
    """Load the client key from text or file. Errors never carry key material."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    source = "private_key" if cfg.private_key else f"key_file {cfg.key_file}"
    try:
        if cfg.private_key:
            data = cfg.private_key.encode()
        elif cfg.key_file:
            data = Path(cfg.key_file).expanduser().read_bytes()
        else:
            raise RunnerError(cfg.host, "no private_key or key_file configured")
        password = cfg.passphrase.encode() if cfg.passphrase else None
        try:
            loaded: Any = serialization.load_ssh_private_key(data, password=password)
        except ValueError:
            loaded = serialization.load_pem_private_key(data, password=password)
        key_class: type[paramiko.PKey]
        if isinstance(loaded, ed25519.Ed25519PrivateKey):
            key_class = paramiko.Ed25519Key
        elif isinstance(loaded, ec.EllipticCurvePrivateKey):
            key_class = paramiko.ECDSAKey
        elif isinstance(loaded, rsa.RSAPrivateKey):
            key_class = paramiko.RSAKey
        else:
            raise RunnerError(cfg.host, f"{source}: unsupported key type {type(loaded).__name__}")
        if cfg.private_key:
            return key_class.from_private_key(io.StringIO(cfg.private_key), password=cfg.passphrase)
        return paramiko.PKey.from_path(Path(cfg.key_file or "").expanduser(), password=cfg.passphrase)
    except RunnerError:
        raise
    except Exception as e:  # crypto libraries raise many types; none may leak the key
        raise RunnerError(
            cfg.host, f"cannot load {source} ({type(e).__name__}): wrong passphrase, or not a private key"
        ) from None
