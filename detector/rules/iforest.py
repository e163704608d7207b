"""The straggler's IsolationForest scores, built from scikit-learn's own trees without the ensemble's overhead.

``IsolationForest(n_estimators, max_samples=min(256, n), random_state=seed).fit(X).score_samples(X)`` spends
most of its ~28 ms (50 trees, 192 GPUs) not in the trees but in the bookkeeping around each one (cloning the
estimator through ``get_params``/``inspect``, parameter and input checks, new random generators), and importing
``sklearn.ensemble`` adds about 0.2 s to start-up. :func:`scores` builds the same trees with scikit-learn's own
tree builder (its Cython criterion, random splitter and depth-first builder), with the same seeds, sample draws,
weights and targets as ``IsolationForest.fit`` (the bagging of scikit-learn 1.9: ``BaseBagging._fit``,
``_parallel_build_estimators``, ``BaseDecisionTree._fit``), and sums their path lengths as ``score_samples``
does, so the scores are the same to the last bit, in about 4 ms. That is checked against scikit-learn's
own IsolationForest by ``tests/detector/test_iforest.py``; a scikit-learn release whose bagging was not
checked (:data:`VERIFIED`) gets the IsolationForest itself.
"""

from __future__ import annotations

import logging

import numpy as np

FloatArray = np.ndarray
IntArray = np.ndarray

#: scikit-learn releases (major.minor) whose IsolationForest this module reproduces bit for bit (the test checks).
VERIFIED = ("1.9",)

#: The modules :func:`scores` imports on its first call (replay imports them beforehand, beside its read).
IMPORTS = ("sklearn.tree._criterion", "sklearn.tree._splitter", "sklearn.tree._tree", "sklearn.utils.random")

_INT32_MAX = np.iinfo(np.int32).max


_broken: list[str] = []  # why the fast path was given up in this process (a private interface changed)


def scores(x: FloatArray, n_estimators: int, seed: int, rows: IntArray | None = None) -> FloatArray:
    """``-IsolationForest(n_estimators, max_samples=min(256, n), random_state=seed).fit(x).score_samples(x[rows])``.

    The forest is fitted on every row of ``x``; only ``rows`` (all when None) are scored: walking each tree costs
    every scored row (0.8 s of a 1.1 s forest at 500,000 rows), fitting it only its 256 draws.

    The fast path uses scikit-learn's private tree classes: a patch release that changes one of them (a
    constructor's arguments, a module moved) makes it raise, and this process then uses the IsolationForest
    itself from there on (logged once) rather than failing the evaluation."""
    import sklearn

    if _broken or ".".join(sklearn.__version__.split(".")[:2]) not in VERIFIED:
        return sklearn_scores(x, n_estimators, seed, rows)
    try:
        return fast_scores(x, n_estimators, seed, rows)
    except (TypeError, AttributeError, ImportError, ValueError) as e:
        _broken.append(f"{type(e).__name__}: {e}")
        logging.getLogger(__name__).warning(
            "scikit-learn %s: its private tree interface differs from what gpufleet builds forests with (%s); "
            "using IsolationForest itself (the same scores, slower)", sklearn.__version__, _broken[0])
        return sklearn_scores(x, n_estimators, seed, rows)


def sklearn_scores(x: FloatArray, n_estimators: int, seed: int, rows: IntArray | None = None) -> FloatArray:
    """The same through scikit-learn's IsolationForest (any release)."""
    from sklearn.ensemble import IsolationForest

    if rows is not None and len(rows) == 0:
        return np.empty(0)
    forest = IsolationForest(n_estimators=n_estimators, max_samples=min(256, x.shape[0]), random_state=seed)
    forest.fit(x)
    out: FloatArray = -forest.score_samples(x if rows is None else x[rows])
    return out


def fast_scores(x: FloatArray, n_estimators: int, seed: int, rows: IntArray | None = None) -> FloatArray:
    """The same from the trees directly (what IsolationForest.fit and score_samples do, in scikit-learn 1.9).

    Each tree is what ``ExtraTreeRegressor(max_features=1, splitter="random", max_depth=d).fit`` builds: its
    criterion, splitter and depth-first builder made as its ``_fit`` makes them for these constant parameters
    (squared error, one output, at least 1 sample a leaf and 2 a split, no weight fraction, no pruning)."""
    from sklearn.tree._criterion import MSE
    from sklearn.tree._splitter import RandomSplitter
    from sklearn.tree._tree import DepthFirstTreeBuilder, Tree
    from sklearn.utils.random import sample_without_replacement

    x32 = np.asarray(x, dtype=np.float32)  # the forest's input check: float32, the layout kept
    n, n_features = x32.shape
    # One legacy generator, re-seeded where the forest makes a new one (seeding is 1 us, a new one 60 us):
    # the same seed gives the same state either way.
    rs = np.random.RandomState(seed)
    y = rs.uniform(size=n)  # the trees' targets (random: only the splits matter)
    y2 = np.ascontiguousarray(np.reshape(y, (-1, 1)), dtype=np.float64)  # one output, as the tree reshapes it
    max_samples = min(256, n)
    max_depth = int(np.ceil(np.log2(max(max_samples, 2))))
    rs.seed(seed)
    seeds = rs.randint(_INT32_MAX, size=n_estimators)
    outputs = np.array([1], dtype=np.intp)
    walked = x32 if rows is None else np.ascontiguousarray(x32[rows])  # the rows scored (tree.apply keeps the layout)
    depths = np.zeros(walked.shape[0], order="F")
    for s in seeds:
        rs.seed(s)
        tree_seed = rs.randint(_INT32_MAX)  # the ensemble's _set_random_states
        rs.seed(s)  # the bagging's indices: every feature, then the samples
        sample_without_replacement(n_features, n_features, random_state=rs)
        indices = sample_without_replacement(n, max_samples, random_state=rs)
        weight = np.bincount(indices, minlength=n).astype(np.float64)  # the samples drawn, as weights
        min_weight_leaf = 0.0 * np.sum(weight)  # min_weight_fraction_leaf 0
        rs.seed(tree_seed)
        splitter = RandomSplitter(MSE(1, n), 1, 1, min_weight_leaf, rs, None)
        tree = Tree(n_features, outputs, 1)
        DepthFirstTreeBuilder(splitter, 2, 1, min_weight_leaf, max_depth, 0.0).build(tree, x32, y2, weight, None)
        leaves = tree.apply(walked)
        path = _average_path_length(tree.n_node_samples)
        depths += tree.compute_node_depths()[leaves] + path[leaves] - 1.0
    denominator = n_estimators * _average_path_length(np.asarray([max_samples]))
    out: FloatArray = 2 ** (-np.divide(depths, denominator, out=np.ones_like(depths), where=denominator != 0))
    return out


def _average_path_length(n_samples_leaf: np.ndarray) -> FloatArray:
    """The average path length of an unsuccessful search in a binary tree of n samples (the forest's formula)."""
    n = n_samples_leaf.reshape((1, -1))
    out = np.zeros(n.shape)
    mask_1 = n <= 1
    mask_2 = n == 2
    not_mask = ~np.logical_or(mask_1, mask_2)
    out[mask_1] = 0.0
    out[mask_2] = 1.0
    out[not_mask] = 2.0 * (np.log(n[not_mask] - 1.0) + np.euler_gamma) - 2.0 * (n[not_mask] - 1.0) / n[not_mask]
    result: FloatArray = out.reshape(n_samples_leaf.shape)
    return result
