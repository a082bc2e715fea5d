"""Control plane: the PPipe MILP planner (python-mip, CBC) and its NP and DART-r baselines.

``plan_cluster`` plans in this process; ``plan_in_subprocess`` and ``plan_async`` plan in a
child process so a daemon stays responsive (see :mod:`ppiped.planner.solve`).
"""

from .api import ALGOS, algo_configs, plan_cluster
from .solve import PlannerFailed, PlannerTimeout, make_request, plan_async, plan_in_subprocess

__all__ = [
    "ALGOS",
    "PlannerFailed",
    "PlannerTimeout",
    "algo_configs",
    "make_request",
    "plan_async",
    "plan_cluster",
    "plan_in_subprocess",
]
