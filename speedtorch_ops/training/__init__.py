"""The training core under the compatible classes and the modules: a step's plan, the row
stores that move a batch's rows, where tables live, and optimizer-state layouts."""

from .plan import Plan, sum_into_owners
from .positions import ColocatedRows
from .stores import RowStore, SeparateTables

__all__ = ["Plan", "sum_into_owners", "RowStore", "SeparateTables", "ColocatedRows"]
