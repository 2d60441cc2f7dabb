"""A run's configuration: the dataclass tree (``schema``) and its YAML files and dotted
overrides (``yaml_io``). ``lp_jax.training.validate`` turns it into a training plan."""
