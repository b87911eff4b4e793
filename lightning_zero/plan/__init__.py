"""Plan a layout before launch: one rank's memory and collectives at any world size, from the real
engine run on the meta device in a fake process group (:func:`plan`, ``lightning-zero plan``)."""

from lightning_zero.plan.core import NOT_MODELED, CollectiveTotal, Plan, plan
from lightning_zero.plan.report import format_plan

__all__ = ["NOT_MODELED", "CollectiveTotal", "Plan", "format_plan", "plan"]
