"""``@task.sky``: a function that returns the run command becomes a whole gang, like ``@task.bash``.

``@task.sky(num_nodes=4, setup=..., resources=...)`` on ``def train(...) -> str`` builds, when
``train(...)`` is called in a DAG, what :func:`~airflow_provider_sky.taskgroup.sky_gang` builds
(cluster, job, one rank task per node, gang sensor, teardown) plus one first task, ``command``,
that calls the function at run time. Why a task of its own: as with ``@task.bash`` the function
gets its arguments' XCom values and context keys (``ds``, ``ti``, ...) only when it runs, and a
bad return value must fail the run before a node is provisioned (the cluster task waits on it).
The returned string is rendered with Jinja like every other templated field, then the cluster and
job tasks read it from XCom (their ``run`` field is ``{{ ti.xcom_pull(...) }}``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk import Context
from airflow.sdk.bases.decorator import DecoratedOperator, determine_kwargs
from airflow.sdk.definitions._internal.contextmanager import DagContext, TaskGroupContext
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION
from airflow.sdk.definitions.context import context_merge
from airflow.sdk.definitions.xcom_arg import PlainXComArg
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.spec.timing import LIMITS, check_timing
from airflow_provider_sky.taskgroup import SkyGangGroup, check_gang_arguments, sky_gang
from airflow_provider_sky.watch.retry import RetryPolicy

#: task id of the task that calls the decorated function, inside the gang's group
COMMAND_TASK_ID = "command"


class SkyCommandOperator(DecoratedOperator):
    """Call the ``@task.sky`` function and return its command, rendered: what every node runs.

    Fails (without retry) naming ``run`` when the function returns anything but a non-empty string,
    so the cluster task downstream never provisions for a command that cannot run.
    """

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, "run")
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        "run": "bash",
    }
    custom_operator_name: str = "@task.sky"
    # the UI's "Rendered Template" shows the command the function returned, not the placeholder
    overwrite_rtif_after_execution: bool = True
    ui_color = "#e8f4ff"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs, **kwargs)
        self.run: Any = SET_DURING_EXECUTION

    def execute(self, context: Context) -> str:
        context_merge(context, self.op_kwargs)
        kwargs = determine_kwargs(self.python_callable, self.op_args, context)
        command = self.python_callable(*self.op_args, **kwargs)
        name = getattr(self.python_callable, "__name__", "the function")
        if not isinstance(command, str) or not command.strip():
            raise AirflowFailException(
                str(
                    SpecError(
                        "run",
                        f"the @task.sky function {name}() must return the shell command every node runs "
                        f"(a non-empty string), it returned {command!r}; nothing was provisioned",
                    )
                )
            )
        rendered = self.render_template(command, context)
        self.run = rendered if isinstance(rendered, str) else str(rendered)  # a native-object DAG
        self.log.info("Every node of the gang will run:\n%s", self.run)
        return str(self._handle_output(self.run))


class SkyTaskDecorator:
    """What ``@task.sky(...)`` returns: call it in a DAG to build the gang; ``.override()`` changes arguments."""

    def __init__(self, function: Callable[..., Any], gang_kwargs: Mapping[str, Any]) -> None:
        if "run" in gang_kwargs:
            raise TypeError(
                "@task.sky: run is what the decorated function returns; do not pass run= to the decorator"
            )
        check_gang_arguments("@task.sky", gang_kwargs, without=("run",))
        # checked when the DAG file decorates, not only when the function is called in a DAG
        check_timing(**{k: v for k, v in gang_kwargs.items() if k in LIMITS})
        RetryPolicy.build(
            gang_kwargs.get("retries", 0),
            gang_kwargs.get("retry_delay", 0.0),
            gang_kwargs.get("retry_exponential_backoff", False),
            gang_kwargs.get("retry_on_exit_codes"),
        )
        self.function = function
        self.gang_kwargs = dict(gang_kwargs)
        self.__name__ = getattr(function, "__name__", "sky")
        self.__doc__ = function.__doc__
        self.__wrapped__ = function

    def override(self, **kwargs: Any) -> SkyTaskDecorator:
        """The same function with some ``@task.sky`` arguments changed (``group_id`` too)."""
        return SkyTaskDecorator(self.function, {**self.gang_kwargs, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> SkyGangResult:
        gang = dict(self.gang_kwargs)
        group_id = _unique_group_id(str(gang.pop("group_id", None) or self.__name__))
        parent = TaskGroupContext.get_current(DagContext.get_current())
        command_id = f"{parent.child_id(group_id) if parent else group_id}.{COMMAND_TASK_ID}"
        # the cluster and job tasks render this at run time: the command task's (already rendered) return
        run = "{{ ti.xcom_pull(task_ids=" + repr(command_id) + ") }}"
        group = sky_gang(group_id, run=run, **gang)
        with group:
            command = SkyCommandOperator(
                task_id=COMMAND_TASK_ID, python_callable=self.function, op_args=args, op_kwargs=kwargs
            )
        if command.task_id != command_id:
            raise RuntimeError(f"@task.sky: expected task id {command_id}, got {command.task_id}")
        command >> group.children[group.child_id("cluster")]
        return SkyGangResult(group)


class SkyGangResult(PlainXComArg):
    """What calling a ``@task.sky`` function returns: the gang's result (its gang sensor's return value,
    as a ``@task.bash`` call's XComArg is its last line), so ``evaluate(train())`` gets it.

    Dependencies set with it act on the whole gang (``a >> train() >> b``: ``a`` before the command
    task, ``b`` after the ranks and the gang sensor), not on the sensor alone. ``.group`` is the TaskGroup.
    """

    def __init__(self, group: SkyGangGroup) -> None:
        super().__init__(operator=group.sensor)
        self.group = group

    @property
    def group_id(self) -> str | None:
        return self.group.group_id

    @property
    def roots(self) -> list[Any]:
        return list(self.group.roots)

    @property
    def leaves(self) -> list[Any]:
        return list(self.group.leaves)

    def set_upstream(self, task_or_task_list: Any, edge_modifier: Any = None) -> None:
        self.group.set_upstream(task_or_task_list, edge_modifier)

    def set_downstream(self, task_or_task_list: Any, edge_modifier: Any = None) -> None:
        self.group.set_downstream(task_or_task_list, edge_modifier)


def _unique_group_id(group_id: str) -> str:
    """``train``, then ``train__1``, ``train__2``...: calling the same decorated function twice in a DAG."""
    dag = DagContext.get_current()
    if dag is None:
        return group_id
    parent = TaskGroupContext.get_current(dag)

    def taken(gid: str) -> bool:
        prefix = (parent.child_id(gid) if parent else gid) + "."
        return any(tid.startswith(prefix) for tid in dag.task_ids)

    n = 0
    unique = group_id
    while taken(unique):
        n += 1
        unique = f"{group_id}__{n}"
    return unique


def sky_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``@task.sky`` / ``@task.sky(num_nodes=4, ...)``: every argument of ``sky_gang`` but ``run``.

    The decorated function returns the command every node runs (templated, like ``@task.bash``);
    calling it in a DAG returns the gang's result as an XComArg (``evaluate(train())``) whose ``>>``
    and ``<<`` act on the whole gang, so ``a >> train() >> b`` works.
    """
    if python_callable is not None:
        if not callable(python_callable):
            raise TypeError("@task.sky takes keyword arguments only, e.g. @task.sky(num_nodes=4)")
        return SkyTaskDecorator(python_callable, kwargs)

    def decorate(function: Callable[..., Any]) -> SkyTaskDecorator:
        return SkyTaskDecorator(function, kwargs)

    return decorate
