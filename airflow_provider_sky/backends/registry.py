"""Which backends exist. Each backend package (``backends/<name>/``) declares one :class:`BackendInfo`
named ``BACKEND`` in its ``__init__``; ``get_provider_info()``, the hooks and :func:`make_backend` read them
here, so adding a backend touches its own folder and nothing else.

A package's ``__init__`` stays light (no client library imported): the backend class is named as
``module:Class`` and imported on first use, so the provider's metadata loads without the optional extras.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_sky.errors import ConnectionConfigError as ConnectionConfigError

if TYPE_CHECKING:
    from airflow_provider_sky.backends.base import Backend

#: the standard connection fields a backend may read (the rest of its settings are extras)
STANDARD_FIELDS = ("host", "schema", "login", "password", "port")


@dataclass(frozen=True)
class BackendInfo:
    """One backend as Airflow and the hooks see it."""

    #: short name (``ssh``), shown in errors and cluster handles
    kind: str
    #: the Airflow connection type (``skyssh``): a URI scheme (RFC 3986: no '_'), or Airflow warns
    #: "Connection schemes shall not contain '_'" each time it reads the connection
    conn_type: str
    #: shown in the connection form's type list
    hook_name: str
    #: the hook class ``airflow_provider_sky.hooks.sky`` exposes for this connection type
    hook_class_name: str
    #: ``module:Class`` of the backend; the class has ``from_config(config)``
    factory: str
    default_conn_id: str
    #: the connection's own fields (stored in extra), as Airflow's ``conn-fields`` declare them
    conn_fields: Mapping[str, Any] = field(default_factory=dict)
    #: standard fields this backend reads; the others are hidden in the form
    standard_fields: tuple[str, ...] = ()
    relabeling: Mapping[str, str] = field(default_factory=dict)
    placeholders: Mapping[str, str] = field(default_factory=dict)
    #: extras accepted besides ``conn_fields`` (spellings kept for older connections)
    extra_aliases: tuple[str, ...] = ()
    #: (extra naming another Airflow connection, ``module:function(config, conn) -> config``): settings
    #: taken from a connection of another provider (``ssh``, ``kubernetes``) instead of asking twice
    linked_conn: tuple[str, str] | None = None
    #: earlier spellings of ``conn_type`` (``sky_ssh``), still read, listed in the form as old names
    former_conn_types: tuple[str, ...] = ()
    #: the linked connection used when that extra is empty, if it exists (the Amazon provider's
    #: ``aws_default``, as its hooks default to it); None: only a named one is linked
    linked_default: str | None = None

    @property
    def all_conn_types(self) -> tuple[str, ...]:
        return (self.conn_type, *self.former_conn_types)

    @property
    def extras(self) -> tuple[str, ...]:
        return tuple(self.conn_fields) + self.extra_aliases

    def backend_class(self) -> type[Backend]:
        module, _, name = self.factory.partition(":")
        cls: type[Backend] = getattr(importlib.import_module(module), name)
        return cls

    def make(self, config: Mapping[str, Any]) -> Backend:
        return self.backend_class().from_config(config)

    def linked_conn_id(self, config: Mapping[str, Any]) -> str | None:
        if self.linked_conn is None:
            return None
        value = config.get(self.linked_conn[0])
        return str(value) if value else self.linked_default

    def linked_by_default(self, config: Mapping[str, Any]) -> bool:
        """The linked connection is the default one, not named: a missing one is no error."""
        return self.linked_conn is not None and not config.get(self.linked_conn[0])

    def merge_linked(self, config: Mapping[str, Any], conn: Any) -> dict[str, Any]:
        """``config`` completed from the linked connection ``conn`` (any object with Airflow's
        ``Connection`` attributes)."""
        assert self.linked_conn is not None
        module, _, name = self.linked_conn[1].partition(":")
        merged: dict[str, Any] = getattr(importlib.import_module(module), name)(config, conn)
        return merged

    def check_extras(self, extras: Mapping[str, Any], conn_id: str) -> None:
        """An unknown extra is a typo until proven otherwise: name it, and the closest known one."""
        known = self.extras
        for key in extras:
            if key in known:
                continue
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "known extras are: " + ", ".join(known)
            raise ConnectionConfigError(
                f"connection {conn_id!r} ({self.conn_type}): unknown extra {key!r}; {hint}"
            )

    def hook_class_for(self, conn_type: str) -> str:
        """The hook class name for one of :attr:`all_conn_types` (Airflow maps each type to its own
        class, whose ``conn_type`` must match): ``SkySSHHook``, and ``SkySSHHook_sky_ssh`` for an old name."""
        return self.hook_class_name if conn_type == self.conn_type else f"{self.hook_class_name}_{conn_type}"

    def hook_name_for(self, conn_type: str) -> str:
        if conn_type == self.conn_type:
            return self.hook_name
        return f"{self.hook_name} ({conn_type}: old type name, same as {self.conn_type})"

    def provider_entries(self, hook_module: str) -> list[dict[str, Any]]:
        """This backend's items of ``get_provider_info()["connection-types"]``: its type, then its old names
        (connections made with them keep their form and Test button)."""
        return [self.provider_entry(hook_module, t) for t in self.all_conn_types]

    def provider_entry(self, hook_module: str, conn_type: str | None = None) -> dict[str, Any]:
        """This backend's item of ``get_provider_info()["connection-types"]`` for ``conn_type``."""
        conn_type = conn_type or self.conn_type
        return {
            "hook-class-name": f"{hook_module}.{self.hook_class_for(conn_type)}",
            "connection-type": conn_type,
            "hook-name": self.hook_name_for(conn_type),
            "ui-field-behaviour": {
                "hidden-fields": [f for f in STANDARD_FIELDS if f not in self.standard_fields],
                "relabeling": dict(self.relabeling),
                "placeholders": dict(self.placeholders),
            },
            "conn-fields": dict(self.conn_fields),
        }


@functools.lru_cache(maxsize=1)
def _discovered() -> tuple[BackendInfo, ...]:
    import airflow_provider_sky.backends as package

    found: list[BackendInfo] = []
    for mod in pkgutil.iter_modules(package.__path__):
        if not mod.ispkg:
            continue
        info = getattr(importlib.import_module(f"{package.__name__}.{mod.name}"), "BACKEND", None)
        if isinstance(info, BackendInfo):
            found.append(info)
    # the embedded default first, then by name: a stable order for the UI and messages
    return tuple(sorted(found, key=lambda i: (i.kind != "local", i.kind)))


def all_backends() -> tuple[BackendInfo, ...]:
    return _discovered()


def kinds() -> tuple[str, ...]:
    return tuple(i.kind for i in _discovered())


def conn_types() -> dict[str, str]:
    """Backend kind -> its connection type, for errors that name a backend (only ones that exist)."""
    return {i.kind: i.conn_type for i in _discovered()}


def by_kind(kind: str) -> BackendInfo:
    for info in _discovered():
        if info.kind == kind:
            return info
    raise ConnectionConfigError(f"unknown backend {kind!r}: use one of {', '.join(kinds())}")


def by_conn_type(conn_type: str, conn_id: str) -> BackendInfo:
    for info in _discovered():
        if conn_type in info.all_conn_types:
            return info
    types = ", ".join(i.conn_type for i in _discovered())
    raise ConnectionConfigError(f"connection {conn_id!r} has type {conn_type!r}; use one of {types}")
