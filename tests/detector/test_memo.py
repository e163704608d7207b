"""detector.core.memo: one-entry memos kept per detector, only within an evaluation's scope."""

from __future__ import annotations

from gpufleet.detector.core import memo


def test_outside_an_evaluation_nothing_is_kept() -> None:
    calls: list[int] = []
    for _ in range(3):
        memo.last("m", "k", lambda: calls.append(1))
    assert len(calls) == 3


def test_the_last_key_is_reused_until_it_changes_and_a_kept_copy_sees_changes_in_place() -> None:
    calls: list[int] = []

    def derive() -> int:
        calls.append(1)
        return len(calls)

    key = ["a", "b"]
    with memo.scope({}):
        assert memo.last("m", key, derive, keep=list) == 1
        assert memo.last("m", key, derive, keep=list) == 1  # the same key: kept
        key[1] = "c"  # changed in place: the copy kept differs
        assert memo.last("m", key, derive, keep=list) == 2
        assert memo.last("other", key, derive, keep=list) == 3  # another name: its own entry
        assert memo.last("m", key, derive, keep=list) == 2
        assert memo.last("m", key, derive, same=lambda a, b: False) == 4


def test_two_detectors_do_not_evict_each_others_memos() -> None:
    calls: list[str] = []

    def derive(k: str) -> str:
        calls.append(k)
        return k

    small: memo.Store = {}
    large: memo.Store = {}
    for _ in range(3):  # alternately, as the benchmarks' fleets of two sizes in one process
        with memo.scope(small):
            assert memo.last("m", "10k", lambda: derive("10k")) == "10k"
        with memo.scope(large):
            assert memo.last("m", "100k", lambda: derive("100k")) == "100k"
    assert calls == ["10k", "100k"]
