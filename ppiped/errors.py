"""The one base class for errors a user can fix; the CLI prints them without a traceback."""

from .cluster import ClusterError
from .plan import PlanError
from .profiles import ProfileError


class InputError(ValueError):
    """Bad input that is not a malformed file: impossible flags, unknown names, infeasible asks."""


UserError = (ClusterError, PlanError, ProfileError, InputError)
