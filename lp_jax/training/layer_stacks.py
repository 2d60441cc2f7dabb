"""The train step's parameters for a model with scanned layers: stacked once per step.

A model with ``scan_layers`` stacks each run of equal layers on every call, so inside the
micro-batch loop the stack is a second FP32 copy of those parameters beside the per-layer
masters the loop carries (28 GB for Llama 3 8B). Here the step stacks them once, before the
loop, and differentiates the stacks: the loop carries the stacks and the gradient sum in the
stacked layout, the per-layer masters are never materialized inside it, and the gradients
are unstacked once after it. Same arithmetic: only where the copy is made changes.

The model says which runs it scans (``scanned_runs()``, layers under ``layers/<i>``) and
builds the stacks (``layer_param_stacks()``); it reads them as ``model(..., layer_stacks=)``
(the optional hooks of ``lp_jax.model_registry.ScannedLayers``). A model without those
methods, or that scans nothing, is differentiated as it is.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

LAYERS = "layers"


def _keys(path) -> tuple:
    """A tree path as plain keys (dict keys, attribute names, sequence indices)."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def _by_path(tree) -> dict:
    return {_keys(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class LayerStacks:
    """How ``params`` (an nnx.State of a model's Params) splits into the leaves outside its
    scanned runs (``outer``, a list) and the runs' stacks (``{start: State}``)."""

    def __init__(self, graphdef, params, rest):
        self._model = nnx.merge(graphdef, params, rest)
        self._params = params
        runs = self._model.scanned_runs() if hasattr(self._model, "scanned_runs") else []
        self.runs = tuple(runs)
        paths_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        run_start = {i: start for start, end in self.runs for i in range(start, end)}
        # Per leaf: None (outer) or (run start, index in the run, path inside the layer).
        self.place = []
        for path, _ in paths_leaves:
            keys = _keys(path)
            if len(keys) > 2 and keys[0] == LAYERS and keys[1] in run_start:
                start = run_start[keys[1]]
                self.place.append((start, keys[1] - start, keys[2:]))
            else:
                self.place.append(None)

    def __bool__(self):
        return bool(self.runs)

    @property
    def model(self):
        """The model merged from the params (for reading its modules, not for running)."""
        return self._model

    def split(self):
        """(outer leaves, stacks) of the params: the stacks are a copy (what to differentiate)."""
        leaves = jax.tree.leaves(self._params)
        return [x for x, where in zip(leaves, self.place) if where is None], self._model.layer_param_stacks()

    def params(self, outer):
        """The Params tree to merge the model from: ``outer`` outside the runs, the original
        leaves inside them (the model reads those runs from the stacks, so they go unread)."""
        it = iter(outer)
        leaves = [next(it) if where is None else x
                  for x, where in zip(jax.tree.leaves(self._params), self.place)]
        return jax.tree.unflatten(self.treedef, leaves)

    def unsplit(self, outer, stacks):
        """A tree like the params from (outer leaves, stacks): the stacks sliced per layer."""
        by_path = {start: _by_path(stack) for start, stack in stacks.items()}
        it = iter(outer)
        leaves = [next(it) if where is None else by_path[where[0]][where[2]][where[1]]
                  for where in self.place]
        return jax.tree.unflatten(self.treedef, leaves)

    def split_specs(self, specs, stacks):
        """(outer specs, stack specs like ``stacks``) from a tree of PartitionSpecs like the
        params: a stack leaf is split as its run's first layer, with the layer axis whole."""
        leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        outer = [s for s, where in zip(leaves, self.place) if where is None]
        first = {}
        for s, where in zip(leaves, self.place):
            if where is not None and where[1] == 0:
                first.setdefault(where[0], {})[where[2]] = P(None, *s)

        def stack_specs(start, stack):
            paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(stack)
            return jax.tree.unflatten(treedef, [first[start][_keys(path)] for path, _ in paths_leaves])

        return outer, {start: stack_specs(start, stack) for start, stack in stacks.items()}
