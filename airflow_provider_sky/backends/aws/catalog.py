"""A small built-in catalog of EC2 instance types, so ``cpus`` / ``memory`` / ``accelerators`` pick one.

Why built in: the choice must be made (and a bad request refused) before anything is created, without a
pricing API call per task. Prices are approximate us-east-1 on-demand dollars per hour, used only to order
the types (the cheapest that fits wins); an ``instance_type`` given by the task is used as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_provider_sky.spec import Resources

#: what a task with no cpus, memory or accelerators gets (as SkyPilot: at least 4 vCPUs)
DEFAULT_CPUS = "4+"
DEFAULT_MEMORY = "16+"


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpus: int
    memory: float  # GiB
    gpu: str | None = None
    gpus: int = 0
    price: float = 0.0

    def describe(self) -> str:
        gpus = f", {self.gpu}:{self.gpus}" if self.gpu else ""
        return f"{self.name} ({self.vcpus} vCPUs, {self.memory:g} GiB{gpus})"


def _t(
    name: str, vcpus: int, memory: float, price: float, gpu: str | None = None, gpus: int = 0
) -> InstanceType:
    return InstanceType(name, vcpus, memory, gpu, gpus, price)


CATALOG: tuple[InstanceType, ...] = (
    _t("t3.micro", 2, 1, 0.0104),
    _t("t3.small", 2, 2, 0.0208),
    _t("t3.medium", 2, 4, 0.0416),
    _t("t3.large", 2, 8, 0.0832),
    _t("c6i.large", 2, 4, 0.085),
    _t("m6i.large", 2, 8, 0.096),
    _t("r6i.large", 2, 16, 0.126),
    _t("c6i.xlarge", 4, 8, 0.17),
    _t("m6i.xlarge", 4, 16, 0.192),
    _t("r6i.xlarge", 4, 32, 0.252),
    _t("c6i.2xlarge", 8, 16, 0.34),
    _t("m6i.2xlarge", 8, 32, 0.384),
    _t("r6i.2xlarge", 8, 64, 0.504),
    _t("c6i.4xlarge", 16, 32, 0.68),
    _t("m6i.4xlarge", 16, 64, 0.768),
    _t("r6i.4xlarge", 16, 128, 1.008),
    _t("m6i.8xlarge", 32, 128, 1.536),
    _t("m6i.16xlarge", 64, 256, 3.072),
    _t("m6i.32xlarge", 128, 512, 6.144),
    _t("g4dn.xlarge", 4, 16, 0.526, "T4", 1),
    _t("g4dn.2xlarge", 8, 32, 0.752, "T4", 1),
    _t("g4dn.12xlarge", 48, 192, 3.912, "T4", 4),
    _t("g4dn.metal", 96, 384, 7.824, "T4", 8),
    _t("g6.xlarge", 4, 16, 0.805, "L4", 1),
    _t("g6.12xlarge", 48, 192, 4.602, "L4", 4),
    _t("g6.48xlarge", 192, 768, 13.35, "L4", 8),
    _t("g5.xlarge", 4, 16, 1.006, "A10G", 1),
    _t("g5.2xlarge", 8, 32, 1.212, "A10G", 1),
    _t("g5.12xlarge", 48, 192, 5.672, "A10G", 4),
    _t("g5.48xlarge", 192, 768, 16.288, "A10G", 8),
    _t("p3.2xlarge", 8, 61, 3.06, "V100", 1),
    _t("p3.8xlarge", 32, 244, 12.24, "V100", 4),
    _t("p3.16xlarge", 64, 488, 24.48, "V100", 8),
    _t("p4d.24xlarge", 96, 1152, 32.77, "A100", 8),
    _t("p4de.24xlarge", 96, 1152, 40.97, "A100-80GB", 8),
    _t("p5.48xlarge", 192, 2048, 98.32, "H100", 8),
)
BY_NAME = {t.name: t for t in CATALOG}


def _fits(quantity: str | None, have: float) -> bool:
    """SkyPilot's reading: ``4`` is exactly 4, ``4+`` at least 4."""
    if not quantity:
        return True
    if quantity.endswith("+"):
        return have >= float(quantity[:-1]) - 1e-9
    return abs(have - float(quantity)) < 1e-9


def gpus_of(instance_type: str) -> int:
    """How many GPUs a catalog type has (0 for a type not in the catalog)."""
    known = BY_NAME.get(instance_type)
    return known.gpus if known else 0


class NoInstanceType(ValueError):
    """Nothing in the catalog fits: (field, message) for the error."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def choose(res: Resources) -> InstanceType:
    """The instance type a node of ``res`` gets: ``instance_type`` as given (an unknown one is taken on
    trust, with what the task says of its GPUs), else the cheapest catalog type that fits."""
    acc = res.accelerators
    if res.instance_type:
        known = BY_NAME.get(res.instance_type)
        if known is None:
            return InstanceType(
                res.instance_type, 0, 0, acc.name if acc else None, acc.gpus_per_node if acc else 0
            )
        if acc is not None and (
            (known.gpu or "").lower() != acc.name.lower() or known.gpus < acc.gpus_per_node
        ):
            raise NoInstanceType(
                "resources.instance_type",
                f"{known.describe()} does not have {acc}; drop instance_type or accelerators, or make them agree",
            )
        return known
    cpus, memory = res.cpus, res.memory
    if acc is None and not cpus and not memory:
        cpus, memory = DEFAULT_CPUS, DEFAULT_MEMORY
    fitting = [
        t
        for t in CATALOG
        if _fits(cpus, t.vcpus)
        and _fits(memory, t.memory)
        and (
            (t.gpu is None)
            if acc is None
            else (t.gpu or "").lower() == acc.name.lower() and t.gpus == acc.gpus_per_node
        )
    ]
    if fitting:
        return min(fitting, key=lambda t: (t.price, t.vcpus, t.name))
    field = "resources.accelerators" if acc is not None else "resources.cpus" if cpus else "resources.memory"
    gpus = sorted({f"{t.gpu}:{t.gpus}" for t in CATALOG if t.gpu})
    asked = ", ".join(
        p
        for p in (
            str(acc) if acc else "",
            f"cpus {cpus}" if cpus else "",
            f"memory {memory}" if memory else "",
        )
        if p
    )
    raise NoInstanceType(
        field,
        f"no instance type of the built-in catalog has {asked} (GPU types: {', '.join(gpus)}); "
        "change the request or give resources.instance_type",
    )
