"""A run's configuration: the dataclass tree (``schema``), its YAML files and dotted
overrides (``yaml_io``), and ``precision.options`` typed by the recipe's fields
(``recipe_options``). ``lp_jax.training.validate`` checks it into a ``ValidatedRun``."""
