"""Connection parsing and precedence as a matrix (field × extra × linked connection → settings), in
milliseconds: no Airflow database, no hosts. The lookups themselves are tested in test_connection_lookup."""

from __future__ import annotations

import json
from typing import Any

import pytest
from airflow.sdk import Connection

import airflow_provider_sky
from airflow_provider_sky.backends import BackendError
from airflow_provider_sky.backends.registry import ConnectionConfigError, all_backends, by_conn_type, by_kind
from airflow_provider_sky.backends.ssh.config import merge_ssh_connection, parse_ssh_config
from airflow_provider_sky.hooks import sky as hooks
from airflow_provider_sky.hooks.sky import connection_config

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----"


def conn(conn_type: str = "sky_ssh", extra: dict[str, Any] | None = None, **fields: Any) -> Connection:
    return Connection(conn_id="c", conn_type=conn_type, extra=json.dumps(extra or {}), **fields)


def ssh_settings(extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    info = by_conn_type("sky_ssh", "c")
    return parse_ssh_config(connection_config(info, conn("sky_ssh", extra, **fields), "c"))


# -- where each setting comes from -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "extra", "hosts"),
    [
        ({"host": "a,b"}, {}, ("a", "b")),
        ({}, {"hosts": "a, b\nc"}, ("a", "b", "c")),
        ({}, {"hosts": ["a", "b"]}, ("a", "b")),
        ({"host": "a,b"}, {"hosts": "a,b"}, ("a", "b")),  # the same value twice is not a contradiction
    ],
)
def test_hosts_come_from_the_host_field_or_the_hosts_extra(
    fields: dict[str, Any], extra: dict[str, Any], hosts: tuple[str, ...]
) -> None:
    assert ssh_settings(extra, **fields).hosts == hosts


@pytest.mark.parametrize(
    ("fields", "extra", "message"),
    [
        ({"host": "a"}, {"hosts": "b"}, "host and hosts: both give the hosts"),
        ({"host": "h", "login": "u"}, {"user": "v"}, "login and user: both give the user"),
        (
            {"host": "h", "password": KEY},
            {"private_key": KEY + "x"},
            "password and private_key: both give the private key",
        ),
        (
            {"host": "h"},
            {"pinned_host_keys": "ssh-ed25519 A", "host_keys": "ssh-ed25519 B"},
            "both give the pinned host keys",
        ),
    ],
)
def test_one_setting_given_twice_differently_is_an_error_naming_both(
    fields: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(BackendError, match=message):
        ssh_settings(extra, **fields)


@pytest.mark.parametrize(
    ("fields", "extra", "key", "key_file"),
    [
        ({"password": KEY}, {}, KEY, None),
        ({}, {"private_key": KEY}, KEY, None),
        ({}, {"key_file": "/k"}, None, "/k"),
        ({}, {}, None, None),
    ],
)
def test_the_key_comes_from_exactly_one_place(
    fields: dict[str, Any], extra: dict[str, Any], key: str | None, key_file: str | None
) -> None:
    s = ssh_settings(extra, host="h", **fields)
    assert (s.private_key, s.key_file) == (key, key_file)


@pytest.mark.parametrize(
    ("fields", "extra"),
    [({"password": KEY}, {"key_file": "/k"}), ({}, {"private_key": KEY, "key_file": "/k"})],
)
def test_a_key_text_and_a_key_file_together_are_refused(
    fields: dict[str, Any], extra: dict[str, Any]
) -> None:
    info = by_conn_type("sky_ssh", "c")
    config = connection_config(info, conn("sky_ssh", extra, host="h", login="u", **fields), "c")
    with pytest.raises(BackendError, match="key_file and private_key both provided"):
        info.make(config)


def test_standard_fields_win_over_nothing_and_numbers_are_checked() -> None:
    s = ssh_settings({"connect_timeout": "2.5", "max_parallel": 4}, host="h", port=2222, login="u")
    assert (s.port, s.user, s.connect_timeout, s.max_parallel) == (2222, "u", 2.5, 4)
    with pytest.raises(BackendError, match="connect_timeout: 'soon' is not a number"):
        ssh_settings({"connect_timeout": "soon"}, host="h")


def test_pinned_keys_read_as_lines_or_a_mapping() -> None:
    assert ssh_settings({"pinned_host_keys": "ssh-ed25519 A\n\nssh-rsa B\n"}, host="h").pinned_host_keys == (
        "ssh-ed25519 A",
        "ssh-rsa B",
    )
    assert ssh_settings({"pinned_host_keys": {"h": "ssh-ed25519 A"}}, host="h").pinned_host_keys == {
        "h": "ssh-ed25519 A"
    }


# -- extras ---------------------------------------------------------------------------------------------------


def test_an_unknown_extra_gets_did_you_mean() -> None:
    with pytest.raises(
        ConnectionConfigError, match="unknown extra 'host_key_polcy'; did you mean 'host_key_policy'"
    ):
        ssh_settings({"host_key_polcy": "skip"}, host="h")
    with pytest.raises(ConnectionConfigError, match="unknown extra 'zzz'; known extras are: state_dir"):
        connection_config(by_kind("local"), conn("sky_local", {"zzz": 1}), "c")


def test_empty_and_old_style_prefixed_extras_are_read() -> None:
    info = by_kind("ssh")
    config = connection_config(
        info,
        conn("sky_ssh", {"extra__sky_ssh__head": "b", "known_hosts": "", "key_file": None}, host="a,b"),
        "c",
    )
    assert config == {"head": "b", "host": "a,b"}


def test_the_local_backend_reads_no_standard_field() -> None:
    config = connection_config(by_kind("local"), conn("sky_local", {"state_dir": "/s"}, host="ignored"), "c")
    assert config == {"state_dir": "/s"}


def test_a_connection_of_another_type_names_the_types_to_use() -> None:
    with pytest.raises(
        ConnectionConfigError,
        match="connection 'c' has type 'ssh'; use one of skylocal, skyaws, skykubernetes, skyssh",
    ):
        by_conn_type("ssh", "c")


# -- a reused ssh connection -------------------------------------------------------------------------------


def ssh_conn(extra: dict[str, Any] | None = None, **fields: Any) -> Connection:
    return Connection(conn_id="s", conn_type="ssh", extra=json.dumps(extra or {}), **fields)


@pytest.mark.parametrize(
    ("ours", "theirs_extra", "expect"),
    [
        ({}, {"private_key": KEY}, {"private_key": KEY}),
        ({}, {"key_file": "/theirs"}, {"key_file": "/theirs"}),
        ({"key_file": "/ours"}, {"private_key": KEY}, {"key_file": "/ours"}),  # the key is taken whole
        ({"password": KEY}, {"key_file": "/theirs"}, {"password": KEY}),
    ],
)
def test_the_key_of_a_reused_ssh_connection_is_taken_whole_or_not_at_all(
    ours: dict[str, Any], theirs_extra: dict[str, Any], expect: dict[str, Any]
) -> None:
    merged = merge_ssh_connection({"ssh_conn_id": "s", **ours}, ssh_conn(theirs_extra, host="a", login="u"))
    keys = {k: merged[k] for k in ("private_key", "password", "key_file") if k in merged}
    assert keys == expect
    parse_ssh_config(merged)  # and the result is one consistent setting


def test_our_fields_win_over_the_reused_connection_and_aliases_count() -> None:
    theirs = ssh_conn(
        {"host_key": "ssh-ed25519 T", "no_host_key_check": "true"}, host="x,y", login="them", port=2
    )
    merged = merge_ssh_connection({"ssh_conn_id": "s", "hosts": "a,b", "user": "us"}, theirs)
    s = parse_ssh_config(merged)
    assert (s.hosts, s.user, s.port, s.host_key_policy) == (("a", "b"), "us", 2, "skip")
    assert s.pinned_host_keys == ("ssh-ed25519 T",)


def test_a_reused_ssh_connection_with_two_keys_is_refused() -> None:
    with pytest.raises(BackendError, match="gives both key_file and private_key"):
        merge_ssh_connection({"ssh_conn_id": "s"}, ssh_conn({"private_key": KEY, "key_file": "/k"}, host="a"))


# -- the registry is the one list ------------------------------------------------------------------------


def test_provider_info_hooks_and_factories_come_from_the_registry() -> None:
    types = airflow_provider_sky.get_provider_info()["connection-types"]
    assert [t["connection-type"] for t in types] == [t for i in all_backends() for t in i.all_conn_types]
    for entry in types:
        info = by_conn_type(entry["connection-type"], "c")
        hook = getattr(hooks, entry["hook-class-name"].rsplit(".", 1)[1])
        # Airflow maps a connection type to a hook class only when the two agree
        assert (hook.conn_type, hook.hook_name, hook.conn_name_attr) == (
            entry["connection-type"],
            entry["hook-name"],
            "sky_conn_id",
        )
        assert info.hook_name in hook.hook_name
        assert callable(info.backend_class().from_config)
        assert set(entry["conn-fields"]) <= set(info.extras)


def test_provider_description_names_the_backends_that_exist() -> None:
    """``airflow providers list`` shows this line: it once claimed an AWS backend before there was one."""
    description = airflow_provider_sky.get_provider_info()["description"]
    names = {"local": "local", "ssh": "SSH", "kubernetes": "Kubernetes", "aws": "AWS EC2"}
    assert {i.kind for i in all_backends()} == set(names)
    assert all(names[i.kind] in description for i in all_backends())


def test_airflow_lists_every_connection_type_with_its_form_and_test_button() -> None:
    """What the connection UI reads: Airflow's own provider registry, through the entry point."""
    import warnings

    from airflow.providers_manager import ProvidersManager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = ProvidersManager()
        registered = pm.hooks
        behaviours = pm.field_behaviours
    for info in all_backends():
        hook = registered[info.conn_type]
        assert hook is not None and hook.connection_testable, info.conn_type
        assert hook.hook_name == info.hook_name
        for old in info.former_conn_types:  # connections made before the rename keep form and Test button
            assert registered[old] is not None and registered[old].connection_testable, old
            assert behaviours[old] == behaviours[info.conn_type]
        hidden = behaviours[info.conn_type]["hidden_fields"]
        assert set(hidden) == {"host", "schema", "login", "password", "port"} - set(info.standard_fields)


# -- name fields match whole: a pasted newline, CR, trailing space or NUL is named, not carried to a node ----


@pytest.mark.parametrize("ending", ["\n", "\r", " ", "\0"], ids=repr)
@pytest.mark.parametrize(
    ("parse", "config", "key"),
    [
        ("ssh", {"host": "h", "login": "ubuntu{}"}, "login"),
        ("ssh", {"host": "h", "user": "ubuntu{}"}, "login"),
        ("ssh", {"host": "h,g", "head": "g{}"}, "head"),
        ("ssh", {"host": "h\0{}"}, "host"),
        ("ssh", {"host": "h", "spare_hosts": "s\0{}"}, "spare_hosts"),
        ("aws", {"private_key": KEY, "region_name": "us-east-1{}"}, "region_name"),
        ("aws", {"private_key": KEY, "zone": "us-east-1a{}"}, "zone"),
        ("aws", {"private_key": KEY, "subnet_id": "subnet-1{}"}, "subnet_id"),
        ("aws", {"private_key": KEY, "security_group_ids": ["sg-1\0{}"]}, "security_group_ids"),
        ("aws", {"private_key": KEY, "key_name": "mykey{}"}, "key_name"),
        ("aws", {"private_key": KEY, "ssh_user": "ubuntu{}"}, "ssh_user"),
        ("aws", {"private_key": KEY, "image_id": "ami-1{}"}, "image_id"),
        ("aws", {"private_key": KEY, "owner": "team{}"}, "owner"),
        ("k8s", {"context": "kind-sky{}"}, "context"),
        ("k8s", {"namespace": "default{}"}, "namespace"),
        ("k8s", {"image": "busybox:latest{}"}, "image"),
        ("k8s", {"service_account": "runner{}"}, "service_account"),
        ("k8s", {"gpu_resource": "nvidia.com/gpu{}"}, "gpu_resource"),
        ("k8s", {"accelerator_label": "skypilot.co/accelerator{}"}, "accelerator_label"),
    ],
)
def test_a_name_field_with_a_bad_ending_is_refused_naming_it(
    parse: str, config: dict[str, Any], key: str, ending: str
) -> None:
    from airflow_provider_sky.backends.aws.config import parse_aws_config
    from airflow_provider_sky.backends.kubernetes.config import parse_kube_config

    parser = {"ssh": parse_ssh_config, "aws": parse_aws_config, "k8s": parse_kube_config}[parse]

    def filled(end: str) -> dict[str, Any]:
        def one(v: str) -> str:
            return v.replace("{}", end) if end else v.replace("\0{}", "").replace("{}", "")

        return {k: [one(i) for i in v] if isinstance(v, list) else one(v) for k, v in config.items()}

    with pytest.raises(BackendError, match=f"^{key}: "):
        parser(filled(ending))
    parser(filled(""))  # the same name without the ending is fine
