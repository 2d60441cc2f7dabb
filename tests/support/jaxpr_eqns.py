"""Counting a traced program's equations, nested jaxprs (custom VJPs, remats, scans) included."""
import jax.extend as jex


def count_eqns(jaxpr, predicate) -> int:
    """Equations of ``jaxpr`` and of every jaxpr nested in it for which ``predicate(eqn)``."""
    return sum(bool(predicate(eqn))
               + sum(count_eqns(sub, predicate) for sub in jex.core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)
