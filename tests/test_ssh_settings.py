"""The SSH backend is built from its settings object, as the Kubernetes and AWS backends are: the
connection is parsed once (backends/ssh/config.py), hosts split into endpoints there; no network."""

from __future__ import annotations

from dataclasses import replace

import pytest

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.ssh.backend import SSHBackend
from airflow_provider_sky.backends.ssh.config import SSHSettings, host_layout, parse_ssh_config

CONFIG = {
    "host": "a, v@b:2222, [::1]:23",
    "login": "u",
    "head": "b:2222",
    "accelerators": '{"a": "H100:8", "*": "L4:1"}',
    "spare_hosts": "w@c",
    "connect_timeout": "5",
}


def test_from_config_keeps_the_parsed_settings() -> None:
    settings = parse_ssh_config(CONFIG)
    backend = SSHBackend.from_config(CONFIG)
    assert backend.settings == settings
    assert backend.endpoints == [("a", 22), ("b", 2222), ("::1", 23)]
    assert backend.head == ("b", 2222)
    assert backend.users == {("a", 22): "u", ("b", 2222): "v", ("::1", 23): "u", ("c", 22): "w"}
    assert backend.spares == [("c", 22)]
    assert backend.declared[("a", 22)].describe() == "8x H100 (declared)"
    assert backend.declared[("::1", 23)].describe() == "1x L4 (declared)"
    assert backend._config("b", 2222).connect_timeout == 5.0


def test_keywords_build_the_same_settings() -> None:
    settings = SSHSettings(hosts=("a", "b"), user="u", port=2200, spare_hosts=("c",))
    by_keywords = SSHBackend(["a", "b"], user="u", port=2200, spare_hosts=["c"])
    assert (by_keywords.endpoints, by_keywords.spares) == (SSHBackend(settings).endpoints, [("c", 2200)])
    with pytest.raises(TypeError, match="takes no other arguments"):
        SSHBackend(settings, user="x")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hosts": ()}, "hosts: the SSH connection lists no hosts"),
        ({"user": ""}, "login: no user for host 'a'"),
        ({"hosts": ("a", "a:22")}, "hosts: 'a:22' is listed twice"),
        ({"head": "z"}, "head: 'z' is not one of the hosts ['a', 'b']"),
        ({"spare_hosts": ("b",)}, "spare_hosts: 'b' is also in hosts"),
        ({"host_key_policy": "trust"}, "host_key_policy: 'trust' is not one of verify, accept-new, skip"),
        ({"private_key": "k", "key_file": "/k"}, "private key: both a key text"),
    ],
)
def test_the_layout_names_the_field_and_the_fix(change: dict[str, object], message: str) -> None:
    settings = replace(SSHSettings(hosts=("a", "b"), user="u"), **change)  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        host_layout(settings)
    with pytest.raises(BackendError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        SSHBackend(settings)
