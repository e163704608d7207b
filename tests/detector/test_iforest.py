"""The straggler's forest scores (detector.rules.iforest) are scikit-learn's IsolationForest scores, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import sklearn

from gpufleet.detector.rules import iforest


def _cases() -> list[tuple[np.ndarray, int]]:
    """Peer-normalized z matrices as the straggler builds them: heavy tails clipped to +-50, a constant column,
    duplicate rows; fewer GPUs than the 256 samples a tree draws, exactly 256, and more (the draws then differ)."""
    rng = np.random.default_rng(23)
    out = []
    for n, f in ((16, 1), (17, 3), (192, 6), (256, 4), (257, 2), (700, 5)):
        for kind in ("tails", "constant", "duplicates"):
            x = np.clip(rng.standard_t(3, size=(n, f)) * 2.0, -50.0, 50.0)
            if kind == "constant":
                x[:, 0] = 0.0
            elif kind == "duplicates":
                x[: n // 2] = x[0]
            out.append((x, int(rng.integers(0, 1000))))
    return out


@pytest.mark.parametrize(("x", "seed"), _cases())
def test_fast_scores_are_isolation_forest_scores(x: np.ndarray, seed: int) -> None:
    # against the IsolationForest itself; a release not checked yet uses the IsolationForest in production (next
    # test): to add it to iforest.VERIFIED, run these cases on it with the skip removed
    if ".".join(sklearn.__version__.split(".")[:2]) not in iforest.VERIFIED:
        pytest.skip(f"scikit-learn {sklearn.__version__} not verified for iforest.fast_scores")
    fast = iforest.fast_scores(x, 50, seed)
    assert fast.dtype == np.float64
    assert np.array_equal(fast, iforest.sklearn_scores(x, 50, seed))


def test_scores_on_the_installed_release() -> None:
    # verified releases take the fast path, others the forest: the same scores either way
    x, seed = _cases()[6]
    assert np.array_equal(iforest.scores(x, 50, seed), iforest.sklearn_scores(x, 50, seed))


def test_unverified_release_uses_the_forest(monkeypatch: pytest.MonkeyPatch) -> None:
    x, seed = _cases()[2]
    monkeypatch.setattr(iforest, "VERIFIED", ())
    called = []
    monkeypatch.setattr(iforest, "fast_scores", lambda *a: called.append(a))
    assert np.array_equal(iforest.scores(x, 50, seed), iforest.sklearn_scores(x, 50, seed))
    assert not called


def test_a_changed_private_interface_falls_back_to_the_forest(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    x, seed = _cases()[3]
    monkeypatch.setattr(iforest, "_broken", [])
    monkeypatch.setattr(iforest, "VERIFIED", (".".join(__import__("sklearn").__version__.split(".")[:2]),))
    calls = []

    def changed(*a: object) -> np.ndarray:  # what a patch release with another constructor signature raises
        calls.append(a)
        raise TypeError("__init__() takes 5 positional arguments but 6 were given")

    monkeypatch.setattr(iforest, "fast_scores", changed)
    want = iforest.sklearn_scores(x, 50, seed)
    assert np.array_equal(iforest.scores(x, 50, seed), want)
    assert np.array_equal(iforest.scores(x, 50, seed), want)
    assert len(calls) == 1, "given up once, not tried on every evaluation"
    assert caplog.text.count("private tree interface differs") == 1


@pytest.mark.parametrize("path", ["fast", "sklearn"])
def test_scoring_some_rows_gives_those_rows_scores(path: str) -> None:
    # the straggler fits on every scored GPU and walks only those the forest can bring to the threshold
    x, seed = _cases()[15]
    if path == "fast" and ".".join(sklearn.__version__.split(".")[:2]) not in iforest.VERIFIED:
        pytest.skip(f"scikit-learn {sklearn.__version__} not verified for iforest.fast_scores")
    fn = iforest.fast_scores if path == "fast" else iforest.sklearn_scores
    rows = np.array([3, 0, 699, 350, 3])
    whole = iforest.sklearn_scores(x, 50, seed)
    assert np.array_equal(fn(x, 50, seed, rows), whole[rows])
    assert fn(x, 50, seed, np.array([], dtype=np.intp)).shape == (0,)
