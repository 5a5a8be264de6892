"""Moved to :mod:`hybridmem.planbooks` (it orchestrates the zoo, capture and the solvers); this path stays
for a release."""
from ..planbooks import cli_plan, dim_names_of, parse_dims, plan_buckets, spec_factory, zoo_factory  # noqa: F401
