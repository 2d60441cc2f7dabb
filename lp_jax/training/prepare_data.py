"""``python -m lp_jax.training.prepare_data``: deprecated; the command is ``python -m
lp_jax.data.prepare_data``. Kept so that job scripts written with this name still run,
with one line on stderr that says so."""
import sys
import warnings

_NOTICE = "lp_jax.training.prepare_data is deprecated; run python -m lp_jax.data.prepare_data"


def __getattr__(name: str):
    # Code that imported the command's entry point from here still finds it.
    if name == "main":
        warnings.warn(_NOTICE, DeprecationWarning, stacklevel=2)
        from lp_jax.data.prepare_data import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    print(_NOTICE, file=sys.stderr)
    from lp_jax.data.prepare_data import main

    sys.exit(main())
